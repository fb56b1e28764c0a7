"""The Megatron-core trainer backend (``--train-backend megatron``, the ``tidal[megatron]`` extra).

``mapping`` (HF <-> Megatron layout, pure), ``vocab`` (vocab-parallel log-probs and entropy, pure),
``model`` (``GPTModel`` stages from HF configs), ``weights`` (the weight source by HF names),
``memory`` (the seed's gradient-buffer policy), ``groups`` (Megatron's process groups destroyed and
rebuilt around a pause), ``step`` (one rollout through Megatron's schedule), ``state`` (checkpoints
and export), ``trainer`` (the ``Trainer`` implementation). Only ``trainer``, ``model``, ``step`` and
``groups`` import megatron-core, and only when called.
"""
