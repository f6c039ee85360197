"""The jaxpr rewrite behind `jaxoverlap.overlap`: pattern matching and jaxpr surgery.

``patterns`` decides, for one jaxpr, which matmul/collective pairs are candidates and whether each
can be replaced without changing what it computes (``reductions`` and ``gathers`` hold the two
directions' rules, ``views`` sees a ``dot_general`` as the ops' 2-D matmul); ``walk`` visits
every jaxpr nested in a traced function (jit, scan, remat, cond, while, shard_map bodies),
splices the jaxoverlap ops in and records one `Candidate` per pair.
"""

from jaxoverlap.rewrite.patterns import Candidate
from jaxoverlap.rewrite.walk import rewrite_closed_jaxpr

__all__ = ["Candidate", "rewrite_closed_jaxpr"]
