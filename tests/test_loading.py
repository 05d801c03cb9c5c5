"""Layer-wise KV loading from disk: pipelined and on-demand loading agree; a bad read mid-request recomputes."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store import DiskStore, KVKey

from conftest import tiny_model

TEXTS = [
    "Lyon sits where the Rhône meets the Saône, two rivers of eastern France.",
    "Granite forms from slowly cooled magma deep underground and is rich in quartz.",
    "The violin has four strings tuned in perfect fifths: G, D, A and E.",
]
QUESTION = "Which rivers meet in Lyon?"


def _engine(tokenizer, path, depth):
    model = tiny_model("qwen2", len(tokenizer))
    return CacheBlendEngine(model, tokenizer, kv_store=DiskStore(path, dtype=torch.float32), prefetch_depth=depth)


def test_pipelined_and_on_demand_loading_give_identical_kv_and_logits(tokenizer, tmp_path):
    ids = _engine(tokenizer, tmp_path, 0).ingest(TEXTS, show_progress=False)
    results = {}
    for depth in (0, 1, 4):
        engine = _engine(tokenizer, tmp_path, depth)  # disk only: every layer is read during the loop
        pre = engine.prefill(ids, QUESTION, recompute_ratio=0.3)
        assert pre.stats["chunk_hits"] == ids and pre.stats["kv_bytes_loaded"] > 0
        results[depth] = pre
    for depth in (1, 4):
        assert torch.equal(results[depth].logits, results[0].logits)
        for a, b in zip(results[depth].keys + results[depth].values, results[0].keys + results[0].values):
            assert torch.equal(a, b)


def test_a_layer_that_fails_mid_request_falls_back_to_computing_the_chunk(tokenizer, tmp_path):
    engine = _engine(tokenizer, tmp_path, 2)
    ids = engine.ingest(TEXTS, show_progress=False)
    reference = engine.prefill(ids, QUESTION, method="full_prefill")
    store = engine.kv_store
    path = store.path_for(KVKey(engine.namespace, ids[1]))
    reader = store.reader(KVKey(engine.namespace, ids[1]))
    assert reader is not None  # the header is fine when the request starts...
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)  # ...but the last layer's bytes are damaged
    path.write_bytes(bytes(data))
    pre = engine.prefill(ids, QUESTION, method="full_reuse")
    assert ids[1] in pre.stats["chunk_misses"]  # recomputed as a hole, not a crash
    assert torch.isfinite(pre.logits).all()
    again = engine.prefill(ids, QUESTION, method="full_reuse")  # the hole was stored again
    assert again.stats["chunk_misses"] == []
    assert torch.allclose(engine.prefill(ids, QUESTION, recompute_ratio=1.0).logits, reference.logits, atol=1e-4)


def test_a_request_that_retries_after_a_bad_read_counts_its_opening_once(tokenizer, tmp_path):
    # A prompt's opening is learned behind once it recurs; a request placed twice (a layer failed to read) is still
    # one sighting, so a one-off prompt never gets a second copy of its chunks
    engine = _engine(tokenizer, tmp_path, 2)
    ids = engine.ingest(TEXTS, show_progress=False)
    path = engine.kv_store.path_for(KVKey(engine.namespace, ids[1]))
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)  # the last layer's bytes are damaged: the request retries with that chunk as a hole
    path.write_bytes(bytes(data))
    prompt = f"Notes follow.\n\n{TEXTS[0]}\n\n{TEXTS[1]}\n\nQ: {QUESTION}\nA:"  # a string: unlike the lead-in
    first = engine.prefill_prompt(prompt, "full_reuse", store_holes=False)
    assert ids[1] in first.stats["chunk_misses"] and first.unlearned == []
    second = engine.prefill_prompt(prompt, "full_reuse", store_holes=False)
    assert [c.chunk_id for c in second.unlearned] == [ids[0]]


def test_disk_reads_are_promoted_to_memory(tokenizer, tmp_path):
    ids = _engine(tokenizer, tmp_path, 0).ingest(TEXTS, show_progress=False)
    model = tiny_model("qwen2", len(tokenizer))
    engine = CacheBlendEngine(model, tokenizer, kv_store=tmp_path)  # memory tier over the same disk
    assert engine.kv_store.stats()["memory"]["entries"] == 0
    first = engine.prefill(ids, QUESTION, method="full_reuse")
    assert engine.kv_store.stats()["memory"]["entries"] >= len(ids)
    second = engine.prefill(ids, QUESTION, method="full_reuse")
    assert torch.equal(first.logits, second.logits)


from cacheblend_rag.loading.controller import LoadingController  # noqa: E402
from cacheblend_rag.loading.profile import ComputeProfile, TierProfile  # noqa: E402

COMPUTE = ComputeProfile(num_tokens=4000, layer_fixed_s=0.002, layer_per_row_s=1e-5, full_prefill_s=8.0)


def _controller(disk_bytes_per_s: float) -> LoadingController:
    tiers = {"memory": TierProfile("memory", 10e9), "disk": TierProfile("disk", disk_bytes_per_s)}
    return LoadingController(COMPUTE, tiers, quality_floor=0.15)


def test_controller_follows_its_inputs():
    layer_bytes = 3000 * 3 * 64 * 2 * 2  # 3000 reused tokens, 3 kv heads, d=64, K+V, fp16
    fast = _controller(1e9).choose_ratio(3000, 100, 4000, {"memory": layer_bytes})
    assert fast.recompute_ratio == 0.15 and fast.balanced_ratio < 0.15  # fast memory: the quality floor
    slowish = _controller(200e6).choose_ratio(3000, 100, 4000, {"disk": layer_bytes})
    slower = _controller(100e6).choose_ratio(3000, 100, 4000, {"disk": layer_bytes})
    assert 0.15 < slowish.recompute_ratio < slower.recompute_ratio <= 1.0  # slower disk → larger r
    crawl = _controller(1e5).choose_ratio(3000, 100, 4000, {"disk": layer_bytes})
    assert crawl.recompute_ratio == 1.0  # capped
    # At the balanced ratio, the estimated recompute of a layer matches its load.
    assert abs(slowish.est_layer_recompute_s - slowish.est_layer_load_s) / slowish.est_layer_load_s < 0.05


def test_auto_ratio_on_an_engine(tokenizer, tmp_path):
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer, kv_store=tmp_path / "kv",
                              home=tmp_path, quality_floor=0.2)
    ids = engine.ingest(TEXTS, show_progress=False)
    pre = engine.prefill(ids, QUESTION, recompute_ratio="auto")
    decision = pre.stats["controller"]
    assert decision["recompute_ratio"] >= 0.2 and pre.stats["recompute_ratio"] == decision["recompute_ratio"]
    assert list((tmp_path / "profiles").glob("*.json"))  # measured once, cached


@pytest.mark.parametrize("floor", [1.5, -0.1, float("nan"), True, "0.2"])
def test_a_bad_quality_floor_is_refused_when_the_engine_is_built(tokenizer, tmp_path, floor):
    """Checked where the engine defines it, before any request (not on the first "auto" one)."""
    with pytest.raises(ConfigError, match="quality_floor"):
        CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer, home=tmp_path, quality_floor=floor)


# ---- profiles on a disk that cannot take the probe (issue 14.5) -------------------------------------------

import logging  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402


from cacheblend_rag.errors import ProfileError  # noqa: E402
from cacheblend_rag.loading.profile import PROBE_PREFIX, measure_disk  # noqa: E402


@pytest.fixture
def small_fs(tmp_path):
    """A real 8 MB tmpfs (smaller than the 64 MB disk probe); skipped where mounting is not permitted."""
    root = tmp_path / "small"
    root.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(root)], capture_output=True,
                                 text=True)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield root
    subprocess.run(["umount", "-l", str(root)], check=False)


def _probes(root) -> list[str]:
    return sorted(p.name for p in root.glob(PROBE_PREFIX + "*"))


def test_disk_probe_on_a_full_filesystem_raises_a_clear_error_and_leaves_nothing(small_fs):
    with pytest.raises(ProfileError, match=r"MiB free, the probe needs .* put the KV store elsewhere \(--home\)"):
        measure_disk(small_fs)
    assert _probes(small_fs) == []


def test_disk_probe_is_removed_when_writing_it_fails_midway(tmp_path):
    """A write that fails after some bytes (here: a file size limit, EFBIG) still removes the probe file."""
    script = (
        "import resource, signal, sys\n"
        "from cacheblend_rag.errors import ProfileError\n"
        "from cacheblend_rag.loading.profile import measure_disk\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "try:\n"
        "    measure_disk(sys.argv[1], 8 << 20, reserve_bytes=0)\n"
        "except ProfileError as e:\n"
        "    print(e)\n"
        "    sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert "cannot measure the disk tier" in done.stdout and "Traceback" not in done.stderr
    assert _probes(tmp_path) == []


def test_stale_probes_of_killed_measurements_are_removed_on_the_next_one(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"{PROBE_PREFIX}{dead.pid}-0123abcd").write_bytes(b"x" * 4096)  # its process is gone
    (tmp_path / f"{PROBE_PREFIX}k2v9_q1x").write_bytes(b"x" * 4096)  # an older version's name (no pid)
    live = tmp_path / f"{PROBE_PREFIX}{os.getpid()}-live"  # a measurement still running
    live.write_bytes(b"x")
    tier = measure_disk(tmp_path, 1 << 20, reserve_bytes=0)
    assert tier.name == "disk" and tier.read_bytes_per_s > 0
    assert _probes(tmp_path) == [live.name]


def test_auto_ratio_on_a_full_disk_degrades_to_a_conservative_profile(tokenizer, small_fs, tmp_path, caplog):
    """The first recompute_ratio="auto" request measures the profiles; a disk that cannot take the probe
    must not fail it: a warning, a slow-disk default, nothing cached (measured again next time), no probe left."""
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer, kv_store=small_fs, home=tmp_path)
    ids = engine.ingest(TEXTS, show_progress=False)
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.loading.profile"):
        pre = engine.prefill(ids, QUESTION, recompute_ratio="auto")
    assert pre.stats["controller"]["recompute_ratio"] >= 0.15 and torch.isfinite(pre.logits).all()
    assert any("cannot measure the disk tier" in r.getMessage() for r in caplog.records)
    assert engine.controller.tiers["disk"].read_bytes_per_s == 100e6
    assert _probes(small_fs) == []
    assert not list((tmp_path / "profiles").glob("*.json"))


@pytest.mark.model
def test_profile_command_on_a_full_disk_prints_an_error(small_fs, tmp_path, capsys):
    from cacheblend_rag import settings
    from cacheblend_rag.cli import main as cli_main

    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(settings.models_dir())  # the converted model, shared
    (home / "kv").symlink_to(small_fs)  # the KV folder is on the small file system
    code = cli_main(["profile", "--remeasure", "--home", str(home), "--dtype", "float32"])
    err = capsys.readouterr().err.splitlines()[-1]  # after the weights' progress bar
    # exit 1: the command failed at run time (exit 2 is kept for bad usage)
    assert code == 1 and err.startswith("error: cannot measure the disk tier") and "MiB free" in err
    assert _probes(home / "kv") == []
