"""The portable memory backend on CPU: per-class policy, bit-exact resume, zero-copy views, real release."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch

from tidal.config.schema import MemoryConfig
from tidal.errors import ConfigError, ResidencyError
from tidal.memory import StateClass, make_backend
from tidal.memory.portable import PortableBackend
from tidal.memory.telemetry import host_rss_bytes, trim_host_heap
from tidal.memory.views import HostView
from tidal.model.load import build_model, resolve_model

S = StateClass
ALL_TRAINER = [S.GRADS, S.OPTIMIZER, S.WEIGHTS, S.ACTIVATIONS]


def _trainer(host_memory="release", tmp_path=None, offload_train=True, seed=0):
    """A real tiny llama with an AdamW step taken, registered with a fresh trainer backend."""
    cfg = MemoryConfig(offload_host_memory=host_memory, offload_disk_dir=str(tmp_path) if tmp_path else None)
    backend = make_backend(cfg, device="cpu", role="trainer", offload_train=offload_train)
    model = build_model(resolve_model("tiny"), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, seed)
    backend.register(S.WEIGHTS, lambda: list(model.parameters()))
    backend.register(
        S.OPTIMIZER, lambda: [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    )
    backend.register(S.GRADS, lambda: [p.grad for p in model.parameters()])
    return backend, model, opt


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    opt.zero_grad(set_to_none=False)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def _snapshot(model, opt):
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = [v.clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return weights, state


def _same(model, opt, snap) -> bool:
    weights, state = snap
    now = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return all(torch.equal(p, weights[n]) for n, p in model.named_parameters()) and all(
        torch.equal(a, b) for a, b in zip(now, state, strict=True)
    )


@pytest.mark.parametrize("host_memory", ["release", "retain", "disk"])
def test_pause_frees_storage_and_resume_is_bit_exact(host_memory, tmp_path):
    backend, model, opt = _trainer(host_memory, tmp_path)
    snap = _snapshot(model, opt)
    param_ids = [id(p) for p in model.parameters()]
    exp_avg_obj = opt.state[model.lm_head.weight]["exp_avg"]
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())

    report = backend.pause(ALL_TRAINER)
    per = {c.state_class: c for c in report.classes}
    # Policy per class under --offload-train: weights and optimizer backed up, grads never.
    assert per["weights"].bytes == per["weights"].backup_bytes == weight_bytes
    assert per["optimizer"].backup_bytes == per["optimizer"].bytes > 2 * weight_bytes
    assert per["grads"].bytes == weight_bytes and per["grads"].backup_bytes == 0
    assert per["activations"].bytes == 0
    assert backend.resident_bytes() == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(p.grad.untyped_storage().nbytes() == 0 for p in model.parameters())
    if host_memory == "disk":
        files = list(tmp_path.rglob("*.bin"))
        assert files and sum(f.stat().st_size for f in files) == per["optimizer"].bytes

    backend.resume(ALL_TRAINER)
    assert _same(model, opt, snap)
    # Identity kept: the optimizer still points at the very same parameter and state objects.
    assert [id(p) for p in model.parameters()] == param_ids
    assert opt.state[model.lm_head.weight]["exp_avg"] is exp_avg_obj
    assert list(tmp_path.rglob("*.bin")) == []
    backend.close()


def test_training_after_resume_matches_training_without_pause(tmp_path):
    """Two pause/resume cycles between steps change nothing: same bits as an unpaused run."""
    backend, model, opt = _trainer("retain", tmp_path, offload_train=False)
    _, ref_model, ref_opt = _trainer("release", tmp_path, offload_train=False)
    for step in range(1, 3):
        backend.pause(ALL_TRAINER)
        backend.resume(ALL_TRAINER)
        _step(model, opt, step)
        _step(ref_model, ref_opt, step)
    assert _same(model, opt, _snapshot(ref_model, ref_opt))


def test_engine_policy_discards_everything():
    backend = make_backend(MemoryConfig(), device="cpu", role="engine")
    weights = torch.randn(1000)
    kv = torch.randn(4000)
    backend.register(S.WEIGHTS, lambda: [weights])
    backend.register(S.KV_CACHE, lambda: [kv])
    rss = host_rss_bytes()
    rep = backend.pause([S.KV_CACHE, S.WEIGHTS])
    assert [(c.state_class, c.bytes, c.backup_bytes) for c in rep.classes] == [
        ("kv_cache", 16000, 0),
        ("weights", 4000, 0),
    ]
    with pytest.raises(ResidencyError, match="without backup"):
        backend.host_view(weights)
    backend.resume([S.WEIGHTS, S.KV_CACHE])
    assert weights.untyped_storage().nbytes() == 4000 and kv.untyped_storage().nbytes() == 16000
    weights.copy_(torch.ones(1000))  # resumed storage is usable (a sync rewrites it)
    assert weights.sum().item() == 1000.0
    assert host_rss_bytes() - rss < 64 * 1024**2


def test_illegal_orders_raise_before_touching_memory():
    backend, model, _ = _trainer()
    with pytest.raises(ResidencyError, match="active"):
        backend.resume([S.WEIGHTS])
    backend.pause([S.WEIGHTS])
    with pytest.raises(ResidencyError, match="double pause"):
        backend.pause([S.OPTIMIZER, S.WEIGHTS])
    assert not backend.is_paused(S.OPTIMIZER)  # the refused call paused nothing
    with pytest.raises(ResidencyError, match="twice"):
        backend.resume([S.WEIGHTS, S.WEIGHTS])
    with pytest.raises(ValueError, match="no policy"):
        backend.pause([S.KV_CACHE])
    backend.resume([S.WEIGHTS])
    assert model.lm_head.weight.untyped_storage().nbytes() > 0


@pytest.mark.parametrize("host_memory", ["release", "retain", "disk"])
def test_host_view_is_zero_copy_and_dies_on_resume(host_memory, tmp_path):
    backend, model, opt = _trainer(host_memory, tmp_path)
    w = model.lm_head.weight
    before_ptr = w.data_ptr()
    expected = w.detach().clone()
    backend.pause(ALL_TRAINER)

    view = backend.host_view(w)
    assert isinstance(view, HostView) and view.device.type == "cpu"
    assert torch.equal(view, expected)
    if host_memory == "release":
        # CPU release moves the block itself into the backup: the view reads the very same bytes.
        assert view.data_ptr() == before_ptr
    # Another view of the same tensor aliases the same backup: no copy per call.
    assert backend.host_view(w).data_ptr() == view.data_ptr()
    row = view[3]  # a slice still aliases the backup, so it stays guarded
    assert isinstance(row, HostView)
    doubled = view * 2  # a fresh result is a plain tensor and outlives the pause
    assert type(doubled) is torch.Tensor
    arr = view.numpy()
    assert arr.ctypes.data == view.data_ptr()
    del arr
    shipped = pickle.loads(pickle.dumps(view))  # what Ray does: a copy, as an ordinary tensor
    assert type(shipped) is torch.Tensor and torch.equal(shipped, expected)

    backend.resume(ALL_TRAINER)
    for stale in (view, row):
        with pytest.raises(ResidencyError, match="after resume"):
            stale.sum()
        with pytest.raises(ResidencyError, match="after resume"):
            torch.zeros(expected.shape[1]).copy_(stale[0] if stale.dim() > 1 else stale)
    with pytest.raises(ResidencyError, match="after resume"):
        view.numpy()
    with pytest.raises(ResidencyError, match="after resume"):
        pickle.dumps(view)
    assert torch.equal(doubled, expected * 2)
    assert torch.equal(w, expected)
    with pytest.raises(ResidencyError, match="not paused"):
        backend.host_view(w)
    backend.close()


def test_retain_keeps_host_buffers_across_cycles():
    backend, model, _ = _trainer("retain")
    w = model.lm_head.weight
    backend.pause([S.WEIGHTS])
    first = backend.host_view(w).data_ptr()
    backend.resume([S.WEIGHTS])
    w.data.add_(1.0)  # training changes the weights between cycles
    expected = w.detach().clone()
    backend.pause([S.WEIGHTS])
    view = backend.host_view(w)
    assert view.data_ptr() == first  # same host buffer, refreshed contents
    assert torch.equal(view, expected)
    backend.resume([S.WEIGHTS])
    assert torch.equal(w, expected)


def test_empty_storages_are_left_alone():
    """Storages already at zero bytes (FSDP's resharded full parameters) are neither freed nor resized."""
    backend = PortableBackend({S.WEIGHTS: make_backend(MemoryConfig(), device="cpu", role="trainer").policy[S.WEIGHTS]})
    full = torch.randn(256)
    full.untyped_storage().resize_(0)
    live = torch.randn(256)
    backend.register(S.WEIGHTS, lambda: [full, live, live[10:20]])  # a view shares its base's storage
    rep = backend.pause([S.WEIGHTS])
    assert rep.classes[0].bytes == 1024
    backend.resume([S.WEIGHTS])
    assert full.untyped_storage().nbytes() == 0 and live.untyped_storage().nbytes() == 1024


def test_without_the_swap_a_backup_read_through_numpy_while_paused_resumes(monkeypatch):
    """torch 2.11 has no ``UntypedStorage._swap_data_ptr_``: pause copies to a host buffer and resume frees it in
    place, which torch refuses for a buffer once shared with numpy (a checksum of the paused weights does that):
    that buffer is dropped instead, and the tensor comes back whole."""
    from tidal.memory import portable

    monkeypatch.setattr(portable, "CAN_SWAP", False)
    backend = PortableBackend({S.WEIGHTS: make_backend(MemoryConfig(), device="cpu", role="trainer").policy[S.WEIGHTS]})
    w = torch.randn(64)
    expect = w.clone()
    backend.register(S.WEIGHTS, lambda: [w])
    backend.pause([S.WEIGHTS])
    assert w.untyped_storage().nbytes() == 0
    assert (backend.host_view(w).numpy() == expect.numpy()).all()
    backend.resume([S.WEIGHTS])
    assert torch.equal(w, expect)


def test_without_the_swap_weights_checksummed_while_live_still_pause(monkeypatch):
    """The checksum and delta views of live weights (``as_numpy_u8``) leave the storage resizable, so the
    portable backend can still free it in place on a torch without the block swap; ``Tensor.numpy()``
    would have made that pause fail ("Trying to resize storage that is not resizable")."""
    from tidal.memory import portable
    from tidal.weight_sync.checksum import as_numpy_u8, tensor_checksum

    monkeypatch.setattr(portable, "CAN_SWAP", False)
    backend = PortableBackend({S.WEIGHTS: make_backend(MemoryConfig(), device="cpu", role="trainer").policy[S.WEIGHTS]})
    w = torch.randn(64)
    before = tensor_checksum(w)
    view = as_numpy_u8(w)
    assert view.nbytes == 256 and (view == w.view(torch.uint8).clone().numpy()).all()
    del view
    backend.register(S.WEIGHTS, lambda: [w])
    backend.pause([S.WEIGHTS])
    assert w.untyped_storage().nbytes() == 0
    backend.resume([S.WEIGHTS])
    assert tensor_checksum(w) == before


def _touched(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(7)  # touch every page so that it counts in RSS
    return t


def test_host_rss_falls_by_released_bytes():
    """A discarded 128 MiB tensor gives its memory back to the OS; a backed-up one costs nothing extra."""
    size = 128 * 1024**2
    backend = make_backend(MemoryConfig(), device="cpu", role="trainer", offload_train=True)
    grads = _touched(size)
    weights = _touched(size)
    backend.register(S.GRADS, lambda: [grads])
    backend.register(S.WEIGHTS, lambda: [weights])
    gc.collect()
    trim_host_heap()

    rss0 = host_rss_bytes()
    rep = backend.pause([S.GRADS, S.WEIGHTS])
    rss_paused = host_rss_bytes()
    assert rep.host_rss_before - rep.host_rss_after >= 0.9 * size
    # Host memory while paused = the backed-up bytes: the discarded grads are gone, the weights'
    # block moved into the backup without a copy.
    assert rss0 - rss_paused >= 0.9 * size
    assert rss0 - rss_paused <= 1.1 * size
    backend.resume([S.GRADS, S.WEIGHTS])
    assert int(weights[12345]) == 7 and weights.untyped_storage().nbytes() == size


def test_make_backend_choices(tmp_path):
    trainer = make_backend(MemoryConfig(), device="cpu", role="trainer", offload_train=True)
    assert trainer.name == "portable"
    assert not trainer.policy[S.GRADS].backup and trainer.policy[S.OPTIMIZER].backup
    assert trainer.policy[S.WEIGHTS].backup and not trainer.policy[S.ACTIVATIONS].backup
    assert make_backend(MemoryConfig(), device="cpu", role="trainer").policy[S.GRADS].backup
    shared = make_backend(MemoryConfig(), device="cpu", role="trainer", weights_host_copy=True)
    assert not shared.policy[S.WEIGHTS].backup  # another host copy exists: never backed up twice
    engine = make_backend(MemoryConfig(), device="cpu", role="engine")
    assert set(engine.policy) == {S.WEIGHTS, S.KV_CACHE} and not any(p.backup for p in engine.policy.values())
    with pytest.raises(ConfigError, match="memory-backend tms"):
        make_backend(MemoryConfig(memory_backend="tms"), device="cpu", role="trainer")
    with pytest.raises(ConfigError, match="offload-disk-dir"):
        make_backend(MemoryConfig(offload_host_memory="disk"), device="cpu", role="trainer")
    with pytest.raises(ValueError, match="role"):
        make_backend(MemoryConfig(), device="cpu", role="critic")


def test_report_metrics_are_flat_and_per_class():
    backend, _, _ = _trainer()
    rep = backend.pause(ALL_TRAINER)
    m = rep.metrics("memory/trainer_pause")
    assert m["memory/trainer_pause/grads/backup_bytes"] == 0
    assert m["memory/trainer_pause/optimizer/bytes"] > 0
    assert m["memory/trainer_pause/seconds"] >= m["memory/trainer_pause/weights/seconds"] >= 0
    assert m["memory/trainer_pause/host_rss_before"] > 0
    backend.resume(ALL_TRAINER)


def test_a_deferred_resume_holds_nan_until_settled():
    """retain defers: the memory is back at once, the bytes (0xFF, NaN, until then) at ``settle``; release cannot."""
    backend, model, opt = _trainer("retain")
    snap = _snapshot(model, opt)
    state = [v for st in opt.state.values() for v in st.values() if v.is_floating_point() and v.dim()]
    assert backend.defers(S.OPTIMIZER) and not make_backend(MemoryConfig(), device="cpu", role="trainer").defers(
        S.OPTIMIZER
    )
    backend.pause(ALL_TRAINER)
    report = backend.resume(ALL_TRAINER, defer=[S.OPTIMIZER])
    m = report.metrics("r")
    assert m["r/optimizer/deferred"] == 1 and "r/weights/deferred" not in m
    assert m["r/optimizer/backup_bytes"] > 0
    assert all(torch.isnan(v).all() for v in state)  # nothing read before settling passes by luck
    assert all(torch.equal(p, snap[0][n]) for n, p in model.named_parameters())  # weights were not deferred
    backend.settle([S.OPTIMIZER])
    backend.settle()  # a second settle: nothing left to do
    assert _same(model, opt, snap)

    # A pause of a class still deferred settles it first: its backup is the real bytes, not the NaN.
    backend.pause([S.OPTIMIZER])
    backend.resume([S.OPTIMIZER], defer=[S.OPTIMIZER])
    backend.pause([S.OPTIMIZER])
    backend.resume([S.OPTIMIZER])
    assert _same(model, opt, snap)
    backend.close()


def test_a_deferred_pause_frees_at_settle_and_its_backup_is_whole():
    """retain: the copy out is made (on a CPU device at once) and the storages freed only by ``settle``; a view,
    a resume or a second settle completes it first, and the bytes come back whole."""
    backend, model, opt = _trainer("retain")
    snap = _snapshot(model, opt)
    report = backend.pause([S.OPTIMIZER, S.GRADS], defer=[S.OPTIMIZER])
    assert report.metrics("p")["p/optimizer/deferred"] == 1 and "p/grads/deferred" not in report.metrics("p")
    assert backend.is_paused(S.OPTIMIZER)
    assert backend.resident_bytes([S.OPTIMIZER]) == report.metrics("p")["p/optimizer/bytes"] > 0  # not yet freed
    assert backend.resident_bytes([S.GRADS]) == 0
    backend.settle()
    assert backend.resident_bytes([S.OPTIMIZER]) == 0
    backend.resume([S.OPTIMIZER, S.GRADS])
    assert _same(model, opt, snap)

    exp_avg = opt.state[model.lm_head.weight]["exp_avg"]
    expected = exp_avg.detach().clone()
    backend.pause([S.OPTIMIZER], defer=[S.OPTIMIZER])
    assert torch.equal(backend.host_view(exp_avg), expected)
    assert backend.resident_bytes([S.OPTIMIZER]) == 0  # the view settled it
    backend.resume([S.OPTIMIZER])
    backend.pause([S.OPTIMIZER], defer=[S.OPTIMIZER])
    backend.resume([S.OPTIMIZER])  # settles the pause first
    assert _same(model, opt, snap)
    backend.close()
