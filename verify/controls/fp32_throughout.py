"""Control: blocked attention computed in fp32 throughout, only the results rounded.

P and dS are not rounded to the input dtype before their matmuls, so this is *more* accurate
than a flash kernel in fp16/bf16 (it skips the largest rounding of the flash algorithm). A
harness whose bound is "k times the baseline error" must still pass it: being better than
the baseline is never a failure.
"""

from flashcheck.verify.mutants._blocked import BlockedAttention


class _Fp32Throughout(BlockedAttention):
    def round_p(self, p, dtype):
        return p

    def round_ds(self, ds, dtype):
        return ds


attention = _Fp32Throughout()
capabilities = attention.capabilities
