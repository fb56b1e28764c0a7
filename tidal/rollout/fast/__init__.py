"""The fast decode path of the embedded engine: static KV cache, on-device sampling, CUDA graphs.

``FastDecoder`` (``decode.py``) generates a batch with transformers' model code but its own KV cache
(``static_cache.py``), attention hook (``attention.py``), sampling (``sampling.py``), request checks
and stop-id cuts (``request.py``) and CUDA graphs of the decode step (``graphs.py``); ``plug.py``
connects it to ``EmbeddedEngine``'s generation step; ``bench.py`` measures it against transformers
``generate``.
"""

from tidal.rollout.fast.decode import FastDecoder
from tidal.rollout.fast.request import DecodeResult, batch_buckets
from tidal.rollout.fast.sampling import SamplingMode, sample, sampling_mode

__all__ = ["DecodeResult", "FastDecoder", "SamplingMode", "batch_buckets", "sample", "sampling_mode"]
