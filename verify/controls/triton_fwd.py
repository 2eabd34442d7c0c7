"""Control: the correct Triton forward every Triton mutant is built on (tiles of 16).

Forward only, fp16 and fp32 (see verify/mutants/_triton_fwd.py for why). If it failed, kills
of the Triton mutants would prove nothing.
"""

from flashcheck.verify.mutants._triton_fwd import TritonForward

attention = TritonForward()
capabilities = attention.capabilities
