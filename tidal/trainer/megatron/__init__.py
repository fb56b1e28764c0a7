"""The Megatron-core trainer backend (``--train-backend megatron``, the ``tidal[megatron]`` extra).

``mapping`` (HF <-> Megatron layout, pure), ``vocab`` (vocab-parallel log-probs and entropy, pure),
``model`` (``GPTModel`` stages from HF configs), ``weights`` (the weight source by HF names),
``memory`` (the seed's gradient-buffer policy), ``trainer`` (the ``Trainer`` implementation).
Only ``trainer`` and ``model`` import megatron-core, and only when called.
"""
