"""Control: the correct blocked PyTorch FA2 kernel every PyTorch mutant is built on.

fp32 accumulation, P and dS rounded to the input dtype, key tiles of 16, FA2 backward. It is
the reference point of the catalogue: if it failed, kills of its mutants would prove nothing.
"""

from flashcheck.verify.mutants._blocked import BlockedAttention

attention = BlockedAttention()
capabilities = attention.capabilities
