"""Request bodies of ``tidal serve``: SGLang's native endpoints, field for field, as pydantic models.

Names and defaults follow SGLang's ``io_struct.py`` (``GenerateReqInput``,
``UpdateWeightFromDiskReqInput``, ...) so that a client written for an SGLang server sends the
same JSON here. Fields SGLang accepts that tidal cannot honour are listed in ``UNSUPPORTED`` and
refused with a 400 naming the field, never silently ignored. Unknown fields are allowed (SGLang
grows fields every release; a client sending a newer one still works) but only the ones declared
here have an effect.

Weight versions are strings, as in SGLang (``server_args.weight_version``); tidal's engines count
versions as integers, so a version that is an integer string also becomes the engine's version.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# Sampling fields SGLang knows that change the output; tidal refuses them rather than ignoring them.
UNSUPPORTED_SAMPLING = (
    "ignore_eos",
    "min_new_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_p",
    "json_schema",
    "regex",
    "ebnf",
    "logit_bias",
)
# Request fields with the same rule.
UNSUPPORTED_REQUEST = ("input_embeds", "image_data", "audio_data", "video_data", "lora_path", "session_params")


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class SamplingParamsIn(_Body):
    """``sampling_params`` of ``/generate`` (SGLang's ``SamplingParams`` constructor arguments)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # SGLang: -1 = off; tidal's engine uses 0 for off
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)
    skip_special_tokens: bool = True
    sampling_seed: int | None = None


class GenerateReqInput(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None


class MemoryTagsReqInput(_Body):
    """``/release_memory_occupation`` and ``/resume_memory_occupation``: ``tags`` None means all."""

    tags: list[str] | None = None


class UpdateWeightFromDiskReqInput(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    flush_cache: bool = True
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False


class UpdateWeightsFromTensorReqInput(_Body):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    # tidal extensions, verified before anything is applied: name -> xxh3-128 hex of each tensor's
    # bytes, and/or tidal's bucket checksum of all the tensors' bytes back to back, in order.
    checksums: dict[str, str] | None = None
    tidal_checksum: str | None = None


class InitWeightsUpdateGroupReqInput(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    load_format: str | None = None
    checksums: dict[str, str] | None = None
    tidal_checksum: str | None = None


class RandomizeWeightsReqInput(_Body):
    """tidal extension (``--check-weight-update-equal``): fill every weight with seeded noise."""

    seed: int = 0


class DestroyWeightsUpdateGroupReqInput(_Body):
    group_name: str = "weight_update_group"


class UpdateWeightVersionReqInput(_Body):
    new_version: str | int
    abort_all_requests: bool = False


class PauseGenerationReqInput(_Body):
    mode: str = "abort"


class AbortReqInput(_Body):
    """``/abort_request``: ``abort_all`` aborts every request (slime's partial rollout sends it)."""

    rid: str = ""
    abort_all: bool = False


class GetWeightsByNameReqInput(_Body):
    name: str
    truncate_size: int = 100


class PullWeightsReqInput(_Body):
    """slime's ``/pull_weights``: apply the newest version published under ``source_dir``."""

    local_checkpoint_dir: str | None = None
    source_dir: str
    target_version: str | int | None = None


def present_unsupported(body: BaseModel, names: tuple[str, ...]) -> list[str]:
    """Fields of ``names`` that the client set to something other than null/false/0."""
    extra: dict[str, Any] | None = body.model_extra
    if not extra:
        return []
    return [n for n in names if extra.get(n) not in (None, False, 0, [], {})]
