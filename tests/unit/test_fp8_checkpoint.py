"""FP8 checkpoints (issue 17: "conversion at load time from the bf16 checkpoint, and loading an FP8
checkpoint if present"): ``mammoth quantize-checkpoint`` writes one, the checkpoint check accepts it
and nothing looser, and the AR loads its codes and row scales as they are, with the very tensors the
load-time conversion makes."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoint, tmp_path_factory) -> pathlib.Path:
    """The tiny checkpoint's FP8 copy, written by the real command."""
    dest = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAMMOTH_")}
    proc = subprocess.run([sys.executable, "-m", "mammoth_app.cli", "quantize-checkpoint", str(tiny_checkpoint),
                           str(dest)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(dest)
    return dest


def test_the_copy_stores_exactly_the_visual_token_weights_as_codes_beside_row_scales(tiny_checkpoint, fp8_checkpoint):
    from mammoth_core.checkpoint import Checkpoint
    from stage_ar.fp8 import QUANTIZATION_CONFIG, quantize_fp8_per_channel
    from stage_ar.fp8_checkpoint import fp8_weight_names

    src, dst = Checkpoint(tiny_checkpoint), Checkpoint(fp8_checkpoint)
    names = fp8_weight_names(src.llm_config)
    assert names and any(".gen_mlp.down_proj." in n for n in names) and any(".q_proj." in n for n in names)
    assert dst.llm_config["quantization_config"] == QUANTIZATION_CONFIG
    infos = dst.tensor_infos()
    assert sorted(infos) == sorted(src.tensor_names() + [n + "_scale" for n in names])
    for name in names:
        assert infos[name].dtype == "F8_E4M3" and infos[name + "_scale"].dtype == "F32"
        assert infos[name + "_scale"].shape == (infos[name].shape[0],)
    from safetensors import safe_open

    name = names[0]
    with safe_open(str(tiny_checkpoint / src.shard_of(name)), framework="pt") as h:
        codes, scale = quantize_fp8_per_channel(h.get_tensor(name))
    with safe_open(str(fp8_checkpoint / dst.shard_of(name)), framework="pt") as h:
        assert torch.equal(h.get_tensor(name).view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(h.get_tensor(name + "_scale"), scale)
    untouched = [n for n in src.tensor_names() if n not in set(names)]
    with safe_open(str(tiny_checkpoint / src.shard_of(untouched[0])), framework="pt") as a, \
            safe_open(str(fp8_checkpoint / dst.shard_of(untouched[0])), framework="pt") as b:
        assert torch.equal(a.get_tensor(untouched[0]), b.get_tensor(untouched[0]))
    for f in ("t2i_generation_config.json", "mammothu.tiktoken"):
        assert (fp8_checkpoint / f).read_bytes() == (tiny_checkpoint / f).read_bytes()


def test_the_check_accepts_the_copy_and_refuses_codes_without_their_scales(fp8_checkpoint, tmp_path):
    from mammoth_core.checkpoint_check import check_parts
    from stage_ar.checkpoint_part import CHECKPOINT_PART

    report = check_parts(fp8_checkpoint, [CHECKPOINT_PART])
    assert report.ok, report.problems
    assert report.dtypes.get("F8_E4M3")
    # the same files without the config's quantization_config: codes where weights are expected
    bare = tmp_path / "bare"
    shutil.copytree(fp8_checkpoint, bare)
    config = json.loads((bare / "config.json").read_text())
    del config["llm_config"]["quantization_config"]
    (bare / "config.json").write_text(json.dumps(config))
    problems = check_parts(bare, [CHECKPOINT_PART]).problems
    assert any("unexpected tensor" in p and p.endswith("weight_scale") for p in problems), problems
    assert any("has dtype F8_E4M3" in p for p in problems), problems
    # codes in another FP8 format where the config announces E4M3: named as such, nothing else offered
    from safetensors.torch import load_file, save_file
    from mammoth_core.checkpoint import Checkpoint
    from stage_ar.fp8_checkpoint import fp8_weight_names

    e5m2 = tmp_path / "e5m2"
    shutil.copytree(fp8_checkpoint, e5m2)
    ckpt = Checkpoint(e5m2)
    name = fp8_weight_names(ckpt.llm_config)[0]
    tensors = load_file(str(e5m2 / ckpt.shard_of(name)))
    tensors[name] = tensors[name].float().to(torch.float8_e5m2)
    save_file(tensors, str(e5m2 / ckpt.shard_of(name)), metadata={"format": "pt"})
    problems = check_parts(e5m2, [CHECKPOINT_PART]).problems
    assert problems == [f"tensor {name} has dtype F8_E5M2; the checkpoint's quantization_config stores it as "
                        f"F8_E4M3 codes beside {name}_scale"], problems
    # a quantization_config this AR does not load is named
    config["llm_config"]["quantization_config"] = {"quant_method": "gptq"}
    (bare / "config.json").write_text(json.dumps(config))
    problems = check_parts(bare, [CHECKPOINT_PART]).problems
    assert any("gptq" in p and "quantize-checkpoint" in p for p in problems), problems


@pytest.mark.parametrize("weights_dtype", ["auto", "fp8"])
def test_the_ar_loads_the_codes_as_stored_equal_to_the_load_time_conversion(tiny_checkpoint, fp8_checkpoint,
                                                                              tmp_path, weights_dtype):
    """Every parameter and buffer of the AR loaded from the FP8 copy (``auto`` means ``fp8`` there)
    equals, bit for bit, the AR loaded from the float32 original with ``weights_dtype: fp8``: the same
    model, and the same tokens for any request."""
    from stage_ar.loader import load_ar

    converted = load_ar(str(tiny_checkpoint), str(tmp_path), "cpu", torch.float32, weights_dtype="fp8").model
    loaded = load_ar(str(fp8_checkpoint), str(tmp_path), "cpu", torch.float32, weights_dtype=weights_dtype).model
    want, got = converted.state_dict(), loaded.state_dict()
    assert sorted(want) == sorted(got)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key].view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else got[key],
                           tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor), key
    assert all(linear.is_fp8 for linear in loaded.visual_token_linears())


def test_the_command_refuses_a_copy_of_a_copy_and_a_full_destination(fp8_checkpoint, tiny_checkpoint, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAMMOTH_")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mammoth_app.cli", "quantize-checkpoint", *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120)

    again = run(str(fp8_checkpoint), str(tmp_path / "again"))
    assert again.returncode == 1 and "stores FP8 weights already" in again.stderr and "Traceback" not in again.stderr
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    refused = run(str(tiny_checkpoint), str(full))
    assert refused.returncode == 1 and "not an empty folder" in refused.stderr, refused.stderr
    assert not (tmp_path / "again").exists() and not (tmp_path / "full.partial").exists()


def test_with_tensor_parallelism_each_rank_loads_its_share_of_the_stored_codes_and_scales(fp8_checkpoint, tmp_path):
    """An FP8 checkpoint on two ranks: column-parallel projections keep the rank's rows of each stacked
    part, codes and row scales alike; row-parallel ones the rank's columns of the codes and every row
    scale (a row's scale multiplies each rank's partial sum alike, so the all-reduce adds them right).
    Before the sharder split ``weight_scale``, a column-parallel shard kept every scale."""
    from mammoth_core.distributed import GroupRank
    from stage_ar.loader import load_ar

    full = load_ar(str(fp8_checkpoint), str(tmp_path), "cpu", torch.float32).model
    c = full.config
    parts = {"qkv_proj": (c.num_attention_heads * c.head_dim, *(2 * [c.num_key_value_heads * c.head_dim])),
             "gate_up_proj": (c.intermediate_size, c.intermediate_size)}
    fp8 = {n: m for n, m in full.named_modules() if getattr(m, "weight_scale", None) is not None}
    for rank in range(2):
        shard = dict(load_ar(str(fp8_checkpoint), str(tmp_path), "cpu", torch.float32,
                             tensor_parallel=GroupRank(rank=rank, world_size=2)).model.named_modules())
        kinds = set()
        for name, f in fp8.items():
            s = shard[name]
            codes, got = f.weight.view(torch.uint8), s.weight.view(torch.uint8)
            sizes = next((v for k, v in parts.items() if name.endswith(k)), None)
            if sizes is None:  # row parallel (o_proj, down_proj): this rank's columns, every row scale
                assert torch.equal(got, codes.chunk(2, dim=1)[rank]) and torch.equal(s.weight_scale, f.weight_scale)
                kinds.add("row")
            else:  # column parallel: this rank's half of each stacked part, codes and scales alike
                keep = torch.cat([torch.arange(start, start + size).chunk(2)[rank]
                                  for start, size in zip(torch.tensor((0, *sizes)).cumsum(0).tolist(), sizes)])
                assert torch.equal(got, codes[keep]) and torch.equal(s.weight_scale, f.weight_scale[keep]), name
                kinds.add("column")
        assert kinds == {"row", "column"}


def _quantize(*args: str, **popen) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAMMOTH_")}
    return subprocess.run([sys.executable, "-m", "mammoth_app.cli", "quantize-checkpoint", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120, **popen)


def _one_line_failure(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip() and " INFO " not in line]
    assert len(lines) == 1 and len(lines[0]) < 400, proc.stderr[-2000:]
    return lines[0]


def test_a_destination_inside_the_source_is_refused_before_anything_is_written(tiny_checkpoint, tmp_path):
    """(break-it pass, 2026-12-07: DEST under a folder of SOURCE made copytree copy the copy into itself
    until RecursionError, leaving hundreds of files in the source.)"""
    src = tmp_path / "src"
    shutil.copytree(tiny_checkpoint, src)
    (src / "out").mkdir()
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    for dest, words in ((src / "out" / "q", "is inside the source folder"), (src / "inner", "is inside the source folder"),
                        (src, "is the source folder")):
        line = _one_line_failure(_quantize(str(src), str(dest))).replace(str(tmp_path), "TMP")
        assert words in line, line
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before


def test_a_run_that_fails_midway_leaves_no_partial_folder_and_names_the_tensor(tiny_checkpoint, tmp_path):
    """(break-it pass: a non-finite weight, or an unreadable shard the AR does not read, failed after the
    copy began and left ``DEST.partial``, which the next run then blamed on an interruption.)"""
    from mammoth_core.checkpoint import Checkpoint
    from safetensors.torch import load_file, save_file
    from stage_ar.fp8_checkpoint import fp8_weight_names

    src = tmp_path / "nan"
    shutil.copytree(tiny_checkpoint, src)
    ckpt = Checkpoint(src)
    name = fp8_weight_names(ckpt.llm_config)[0]
    shard = src / ckpt.shard_of(name)
    tensors = load_file(str(shard))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    line = _one_line_failure(_quantize(str(src), str(tmp_path / "out")))
    assert name in line and "non-finite" in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    # a missing parent folder is not created
    line = _one_line_failure(_quantize(str(tiny_checkpoint), str(tmp_path / "no" / "such" / "q")))
    assert f"{tmp_path}/no/such does not exist" in line, line
    assert not (tmp_path / "no").exists()


def test_a_destination_that_is_a_file_or_a_link_is_refused_by_name(tiny_checkpoint, tmp_path):
    (tmp_path / "afile").write_text("")
    def words(*args: str) -> str:
        return _one_line_failure(_quantize(*args)).replace(str(tmp_path), "TMP")

    assert "TMP/afile is a file" in words(str(tiny_checkpoint), str(tmp_path / "afile"))
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert "TMP/link is a symbolic link" in words(str(tiny_checkpoint), str(tmp_path / "link"))
    assert not (tmp_path / "link.partial").exists()
    assert "TMP/nothere does not exist" in words(str(tmp_path / "nothere"), str(tmp_path / "q"))


def test_row_scales_that_are_not_finite_and_positive_are_refused_by_the_check_and_the_loader(fp8_checkpoint,
                                                                                             tmp_path):
    """(break-it pass, 2026-12-07: a ``weight_scale`` holding NaN, Inf, 0 or a negative value passed the
    check and loaded; NaN then failed every request with an unhelpful message, 0 or negative silently
    gave garbage.) The check reads the row scales (small: one float per output row) and names the tensor;
    the loader runs the check first, so it refuses too."""
    from mammoth_core.checkpoint import Checkpoint, CheckpointError
    from mammoth_core.checkpoint_check import check_parts
    from safetensors.torch import load_file, save_file
    from stage_ar.checkpoint_part import CHECKPOINT_PART
    from stage_ar.fp8_checkpoint import fp8_weight_names
    from stage_ar.loader import load_ar

    bad = tmp_path / "bad"
    shutil.copytree(fp8_checkpoint, bad)
    ckpt = Checkpoint(bad)
    name = fp8_weight_names(ckpt.llm_config)[-1] + "_scale"
    shard = bad / ckpt.shard_of(name)
    original = load_file(str(shard))
    for value in (float("nan"), float("inf"), 0.0, -0.5):
        tensors = dict(original)
        tensors[name] = tensors[name].clone()
        tensors[name][1] = value
        save_file(tensors, str(shard), metadata={"format": "pt"})
        problems = check_parts(bad, [CHECKPOINT_PART]).problems
        assert len(problems) == 1 and name in problems[0] and "finite" in problems[0], (value, problems)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_ar(str(bad), str(tmp_path), "cpu", torch.float32)


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_an_index_placing_a_shard_outside_the_folder_is_refused_and_the_shard_left_alone(tiny_checkpoint, tmp_path,
                                                                                         where):
    """(break-it pass, 2026-12-07: a weight_map entry ``../x.safetensors`` or an absolute path made the copy
    write outside DEST, rewriting that source shard in place, and the check said OK.) A shard is a file
    name in the checkpoint folder: the index is refused where it is read, naming the entry."""
    src = tmp_path / "src"
    shutil.copytree(tiny_checkpoint, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "outside.safetensors"
    (src / shard).rename(outside)
    entry = "../outside.safetensors" if where == "relative" else str(outside)
    index["weight_map"] = {k: entry if v == shard else v for k, v in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    before = outside.read_bytes()
    line = _one_line_failure(_quantize(str(src), str(tmp_path / "out")))
    assert repr(entry) in line and "model.safetensors.index.json" in line, line
    assert outside.read_bytes() == before
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "t2i_generation_config.json", "config.json"])
def test_a_json_file_that_does_not_parse_is_named_in_one_line(tiny_checkpoint, tmp_path, name):
    """(break-it pass, 2026-12-07: ``{oops`` in the index or the generation config gave the parser's
    message without the file's name.)"""
    src = tmp_path / "src"
    shutil.copytree(tiny_checkpoint, src)
    (src / name).write_text("{oops")
    line = _one_line_failure(_quantize(str(src), str(tmp_path / "out")))
    assert f"{name} is not valid JSON" in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def _drop_permission_overrides() -> None:
    """preexec_fn: drop the capabilities that let root ignore file permissions (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH, CAP_FOWNER) from the child's bounding set, so that the program it executes
    (with no inheritable capabilities) obeys a folder's mode as any other user does."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _as_a_user(tmp_path: pathlib.Path):
    """The preexec_fn under which a child obeys file permissions: none for a user, the capability drop
    for root (which writes into read-only folders: a read-only case could not be staged). Checked with
    a probe, so the read-only cases below test what they say."""
    preexec = _drop_permission_overrides if os.geteuid() == 0 else None
    probe = tmp_path / "probe"
    probe.mkdir()
    probe.chmod(0o555)
    try:
        proc = subprocess.run([sys.executable, "-c", f"open({str(probe / 'x')!r}, 'w')"], preexec_fn=preexec,
                              capture_output=True, text=True, timeout=60)
    finally:
        probe.chmod(0o755)
        shutil.rmtree(probe)
    assert "PermissionError" in proc.stderr, ("a read-only folder cannot be staged here", proc.stderr)
    return preexec


def _same_files(a: pathlib.Path, b: pathlib.Path) -> None:
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name


@pytest.mark.parametrize("parent", ["writable", "read-only"])
def test_an_existing_empty_destination_folder_is_filled_where_it_is(fp8_checkpoint, tiny_checkpoint, tmp_path, parent):
    """(break-it pass, 2026-12-07: DEST an existing empty folder that cannot be removed or renamed, such as
    a Kubernetes emptyDir or PVC mount point (EBUSY): the copy went to ``DEST.partial`` beside it, and the
    final ``rmdir(DEST)`` and rename failed, leaving ``DEST.partial``.) The copy is written into a hidden
    folder inside DEST and moved up entry by entry; DEST itself is neither removed nor renamed. A
    read-only parent stands for the mount point (``rmdir(DEST)`` fails there with EACCES)."""
    dest = tmp_path / "mnt" / "dest"
    dest.mkdir(parents=True)
    preexec = _as_a_user(tmp_path)
    if parent == "read-only":
        dest.parent.chmod(0o555)
    try:
        proc = _quantize(str(tiny_checkpoint), str(dest), preexec_fn=preexec)
    finally:
        dest.parent.chmod(0o755)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [p.name for p in dest.parent.iterdir()] == ["dest"]
    _same_files(dest, fp8_checkpoint)  # the same copy as into a new folder, nothing hidden left


#: A process that copies SOURCE to DEST for each ``SOURCE<TAB>DEST`` line it reads, answering ``ok`` or
#: ``failed <message>``: torch imported once, and two such processes start a copy within a millisecond.
_COPIER = """
import sys
import time
from stage_ar.fp8_checkpoint import write_fp8_checkpoint
print("ready", flush=True)
for line in sys.stdin:
    try:
        write_fp8_checkpoint(*line.rstrip("\\n").split("\\t"))
        print("ok", flush=True)
    except Exception as exc:
        print("failed", " ".join(str(exc).split()), flush=True)
"""


def test_two_runs_to_one_destination_at_once_leave_one_complete_copy(fp8_checkpoint, tiny_checkpoint, tmp_path):
    """(break-it pass, 2026-12-07: of two runs started at once to one DEST, the loser's clean-up removed the
    winner's partial folder, and the winner exited 0 with a copy lacking config.json and the tokenizer, or
    failed too.) The partial folder is created exclusively and a run removes only the folder it created:
    each time, one run succeeds with a complete copy and the other is refused, leaving nothing behind.
    Two real processes, each told to start by one line on its stdin, written to both at once."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAMMOTH_")}
    copiers = [subprocess.Popen([sys.executable, "-c", _COPIER], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        assert [c.stdout.readline() for c in copiers] == ["ready\n"] * 2
        for attempt in range(10):
            dest = tmp_path / f"q{attempt}"
            for c in copiers:
                c.stdin.write(f"{tiny_checkpoint}\t{dest}\n")
            for c in copiers:
                c.stdin.flush()
            answers = sorted(c.stdout.readline().strip() for c in copiers)
            assert answers[0].startswith("failed") and answers[1] == "ok", (attempt, answers)
            _same_files(dest, fp8_checkpoint)
            assert sorted(p.name for p in tmp_path.iterdir()) == [f"q{i}" for i in range(attempt + 1)]
    finally:
        for c in copiers:
            c.stdin.close()
            c.wait(timeout=60)


def test_another_runs_partial_folder_is_refused_and_left_alone(tiny_checkpoint, tmp_path):
    """The partial folder of a run under way (or killed: SIGKILL cannot be cleaned up after), beside a new
    DEST or inside an empty one, makes the next run refuse, naming it, and stay away from it."""
    from stage_ar.fp8_checkpoint import partial_folder

    for dest in (tmp_path / "new", tmp_path / "empty"):
        if dest.name == "empty":
            dest.mkdir()
        partial = partial_folder(dest)
        partial.mkdir()
        (partial / "theirs").write_text("")
        line = _one_line_failure(_quantize(str(tiny_checkpoint), str(dest)))
        assert f"{partial} exists" in line, line
        assert [p.name for p in partial.iterdir()] == ["theirs"]


def test_a_read_only_source_is_copied_into_a_writable_copy(fp8_checkpoint, tiny_checkpoint, tmp_path):
    """(break-it pass, 2026-12-07: with the source's files 0444 or its folder 0555, as a read-only volume
    mounts them, the copy took their modes, so the tool could not write its own config.json into it, and
    a 0555 partial folder could not be removed.) Contents are copied, not modes."""
    preexec = _as_a_user(tmp_path)
    src = tmp_path / "src"
    shutil.copytree(tiny_checkpoint, src)
    for f in src.iterdir():
        f.chmod(0o444)
    src.chmod(0o555)
    try:
        proc = _quantize(str(src), str(tmp_path / "out"), preexec_fn=preexec)
    finally:
        src.chmod(0o755)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    _same_files(tmp_path / "out", fp8_checkpoint)
    assert all(f.stat().st_mode & 0o200 for f in [tmp_path / "out", *(tmp_path / "out").iterdir()])


@pytest.mark.parametrize("dest_exists", [False, True])
def test_a_full_disk_is_one_line_naming_the_destination(tiny_checkpoint, tmp_path, dest_exists):
    """(break-it pass, 2026-12-07: a write failing for want of space gave safetensors' SafetensorError as a
    traceback.) The disk is filled for real, as far as the process is concerned: RLIMIT_FSIZE of 1 MiB
    lets the small files through and makes the first shard's write fail (EFBIG, "File too large"). An
    existing empty DEST is left as it was found, a new one is not made."""
    import resource

    dest = tmp_path / "out"
    if dest_exists:
        dest.mkdir()

    def small_files_only() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    line = _one_line_failure(_quantize(str(tiny_checkpoint), str(dest), preexec_fn=small_files_only))
    assert str(dest) in line and "File too large" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if dest_exists else [])
    assert not dest_exists or not any(dest.iterdir())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_run_ended_by_sigterm_or_sighup_removes_its_partial_folder(tiny_checkpoint, tmp_path, signum):
    """(break-it pass, 2026-12-07: SIGTERM, as Kubernetes ends a pod, or SIGHUP, a closed terminal, during
    a copy left ``DEST.partial``, and every later run refused to start; SIGINT was handled.) The signal
    is sent to a real run while it writes: stopped (SIGSTOP) once its partial folder appears, so the
    signal surely lands mid-copy, then continued. The run exits 128 + the signal's number and leaves
    nothing; a rerun succeeds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAMMOTH_")}
    dest, partial = tmp_path / "out", tmp_path / "out.partial"
    run = subprocess.Popen([sys.executable, "-m", "mammoth_app.cli", "quantize-checkpoint", str(tiny_checkpoint),
                            str(dest)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not partial.exists():
            assert run.poll() is None, run.communicate()
            time.sleep(0.001)
        run.send_signal(signal.SIGSTOP)
        assert partial.exists() and not dest.exists()  # stopped mid-copy
        run.send_signal(signum)
        run.send_signal(signal.SIGCONT)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 128 + signum, (run.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    assert list(tmp_path.iterdir()) == []
    assert _quantize(str(tiny_checkpoint), str(dest)).returncode == 0


def test_dest_dot_is_the_current_folder(fp8_checkpoint, tiny_checkpoint, tmp_path):
    """(break-it pass, 2026-12-07: ``quantize-checkpoint SRC .`` in an empty folder failed with
    "PosixPath('.') has an empty name".)"""
    here = tmp_path / "here"
    here.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAMMOTH_")} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "mammoth_app.cli", "quantize-checkpoint", str(tiny_checkpoint), "."],
                          cwd=here, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(here)
    _same_files(here, fp8_checkpoint)


def test_a_linked_folder_inside_the_source_is_refused_by_name_and_nothing_above_it_is_copied(tiny_checkpoint,
                                                                                            tmp_path):
    """(break-it pass, 2026-12-07 night: a link in the source to a folder above it was followed, so the copy
    copied every sibling checkpoint into itself, level after level, until a 4 KB file name stopped it;
    in a models folder that fills the disk.) Linked files are copied (a Hugging Face snapshot's files are
    links to its blobs); a linked folder is refused, naming it, before anything is written."""
    src = tmp_path / "models" / "src"
    shutil.copytree(tiny_checkpoint, src)
    (tmp_path / "models" / "other").mkdir()
    (tmp_path / "models" / "other" / "big.bin").write_bytes(b"x" * 1024)
    (src / "up").symlink_to(tmp_path / "models")
    (src / "tokenizer_link.json").symlink_to(src / "config.json")  # a linked file is fine
    line = _one_line_failure(_quantize(str(src), str(tmp_path / "models" / "q"))).replace(str(tmp_path), "TMP")
    assert "TMP/models/src/up is a symbolic link to a folder" in line, line
    assert len(line) < 400, line
    assert not (tmp_path / "models" / "q").exists() and not (tmp_path / "models" / "q.partial").exists()


@pytest.mark.parametrize("source, words", [
    ("builtin://tiny", "builtin://tiny is a URI: quantize-checkpoint takes a checkpoint folder"),
    ("", "no source folder given"),
])
def test_a_source_that_is_not_a_folder_path_is_named_as_typed(tmp_path, source, words):
    """(break-it pass, 2026-12-07 night: ``builtin://tiny`` was reported as ``builtin:/tiny does not
    exist``, and ``""`` was taken for the current folder.)"""
    line = _one_line_failure(_quantize(source, str(tmp_path / "q")))
    assert words in line, line
    assert not (tmp_path / "q").exists()
