import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_model, make_tokenizer

from tidal.train import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[2]


def test_save_load_round_trip(tmp_path):
    model = make_model()
    path = ckpt.save_checkpoint(
        tmp_path, 5, model.save_pretrained, None, {"optimizer": {"x": torch.ones(2)}}, {"data": {"epoch": 1}}
    )
    assert path == tmp_path / "checkpoints" / "step_5"
    assert ckpt.latest_checkpoint(tmp_path) == path
    trainer_state, state = ckpt.load_checkpoint(path)
    assert set(state.pop("files")) == {"config.json", "generation_config.json", "model.safetensors", "trainer_state.pt"}
    assert state == {"data": {"epoch": 1}, "step": 5}
    assert torch.equal(trainer_state["optimizer"]["x"], torch.ones(2))


def test_rng_state_is_restored(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, make_model().save_pretrained, None, {}, {})
    expected = torch.rand(3)
    ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))
    assert torch.equal(torch.rand(3), expected)


class RunsCode:
    """Unpickling this runs `touch MARKER`: what a crafted trainer_state.pt did to `--resume`."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def test_a_trainer_state_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 2, make_model().save_pretrained, None, {"optimizer": {}}, {"data": {}})
    marker = tmp_path / "code_ran"
    torch.save({"optimizer": {}, "rng": RunsCode(marker)}, path / "trainer_state.pt")
    for load in (ckpt.load_checkpoint, lambda p: ckpt.read_trainer_state(p / "trainer_state.pt", mmap=True)):
        with pytest.raises(ckpt.CheckpointError) as err:
            load(path)
        message = str(err.value)
        assert message.startswith(f"{path / 'trainer_state.pt'}: refused to load: it holds Python objects other ")
        assert "GLOBAL posix.system" in message  # what was refused
        assert "weights_only=False" not in message  # torch's advice, which is the attack
        assert not marker.exists()


def test_a_damaged_checkpoint_file_is_named(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 2, make_model().save_pretrained, None, {"optimizer": {}}, {"data": {}})
    state = path / "trainer_state.pt"
    good = state.read_bytes()
    state.write_bytes(good[: len(good) // 2])  # cut short, as a full disk or a bad copy leaves it
    with pytest.raises(ckpt.CheckpointError, match=r"trainer_state.pt: cannot be read as a checkpoint's trainer state"):
        ckpt.load_checkpoint(path)
    state.write_bytes(good)
    (path / "state.json").write_text('{"data": {}}')
    with pytest.raises(ckpt.CheckpointError, match=r"state.json: expected a JSON object with an integer 'step'"):
        ckpt.load_checkpoint(path)


def test_the_trainer_state_of_a_real_optimizer_loads_with_the_safe_reader(tmp_path):
    """AdamW and LambdaLR state (tensors, floats, tuples, None) and both RNG states are plain data,
    so a checkpoint tidal wrote, old or new, loads under `weights_only=True` and restores exactly."""
    import random

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    model(torch.tensor([[3, 4, 5]])).logits.sum().backward()
    opt.step()
    sched.step()
    saved = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    path = ckpt.save_checkpoint(tmp_path, 1, model.save_pretrained, None, saved, {"data": {}})
    expected_python, expected_torch = random.random(), torch.rand(2)
    trainer_state, _ = ckpt.load_checkpoint(path)
    assert random.random() == expected_python
    assert torch.equal(torch.rand(2), expected_torch)
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(trainer_state["optimizer"])
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95)
    for p in model.parameters():
        assert torch.equal(opt2.state[p]["exp_avg"], opt.state[p]["exp_avg"])
    assert trainer_state["scheduler"] == sched.state_dict()


def test_a_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = make_model()
    ckpt.save_checkpoint(tmp_path, 2, model.save_pretrained, None, {}, {"data": {}})

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", boom)
    with pytest.raises(ckpt.CheckpointSaveError) as err:
        ckpt.save_checkpoint(tmp_path, 4, model.save_pretrained, None, {}, {"data": {}})
    step_2 = tmp_path / "checkpoints" / "step_2"
    assert str(err.value) == (
        f"saving checkpoint {tmp_path / 'checkpoints' / 'step_4'}: OSError: disk full; "
        f"the newest intact checkpoint is {step_2}"
    )
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]  # no half-written step_4
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_2"
    assert json.loads((root / "step_2" / "state.json").read_text())["step"] == 2


def test_resume_picks_the_newest_complete_checkpoint_whatever_latest_says(tmp_path, caplog):
    model = make_model()
    for step in (2, 4):
        ckpt.save_checkpoint(tmp_path, step, model.save_pretrained, None, {}, {"data": {}})
    root = tmp_path / "checkpoints"
    (root / "step_6").mkdir()  # a folder with model files but no state: never finished
    model.save_pretrained(root / "step_6")
    (root / "latest").write_text("step_9\n")  # names a folder deleted by hand
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_4"
    assert "names step_9; the newest complete checkpoint is step_4" in caplog.text
    (root / "latest").unlink()
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_4"
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 4]
    assert ckpt.latest_checkpoint(tmp_path / "nothing") is None


def test_keep_checkpoints_deletes_the_oldest_after_the_new_one_is_complete(tmp_path, monkeypatch):
    model = make_model()
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, model.save_pretrained, None, {}, {"data": {}}, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_3"]

    # a save that fails deletes nothing: the two complete ones stay
    monkeypatch.setattr(ckpt.torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(ckpt.CheckpointSaveError, match="OSError: disk full"):
        ckpt.save_checkpoint(tmp_path, 4, model.save_pretrained, None, {}, {"data": {}}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_3"]
    monkeypatch.undo()
    for step in (4, 5):  # keep=0 keeps everything
        ckpt.save_checkpoint(tmp_path, step, model.save_pretrained, None, {}, {"data": {}}, keep=0)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3, 4, 5]


def test_a_save_fsyncs_every_file_and_folder_before_the_rename(tmp_path, monkeypatch):
    import os

    synced, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    renamed = {}

    def replace(src, dst):
        if os.path.basename(dst) == "step_3":  # what was on disk when the folder was published
            renamed["synced"] = set(synced)
            renamed["files"] = {os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs} | {str(src)}
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    ckpt.save_checkpoint(tmp_path, 3, make_model().save_pretrained, make_tokenizer(), {}, {"data": {}})
    names = {os.path.basename(f) for f in renamed["files"]}
    assert {"model.safetensors", "config.json", "tokenizer.json", "trainer_state.pt", "state.json"} <= names
    assert renamed["files"] <= renamed["synced"]  # every file and the folder itself
    assert str(tmp_path / "checkpoints") in synced  # and the parent, after the rename


def test_stale_temp_folders_of_a_killed_save_are_removed_on_the_next_save(tmp_path):
    model = make_model()
    ckpt.save_checkpoint(tmp_path, 2, model.save_pretrained, None, {}, {"data": {}})
    root = tmp_path / "checkpoints"
    (root / ".step_4.ab12cd").mkdir()  # what atomic_directory leaves when the process is killed
    (root / ".step_4.ab12cd" / "model.safetensors").write_bytes(b"half")
    (root / ".latest.0123456789ab.tmp").write_text("step_4")
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_2"
    ckpt.save_checkpoint(tmp_path, 6, model.save_pretrained, None, {}, {"data": {}})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_6"]


def test_export_writes_a_plain_hf_folder_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidal.cli import main

    model, tok = make_model(seed=3), make_tokenizer()
    ckpt.save_checkpoint(tmp_path, 2, model.save_pretrained, tok, {"optimizer": {}}, {"data": {}})
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2)  # step 4 differs from step 2
    ckpt.save_checkpoint(tmp_path, 4, model.save_pretrained, tok, {"optimizer": {}}, {"data": {}})

    assert main(["export", str(tmp_path), "--step", "2", "--out", str(tmp_path / "hf2")]) == 0
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "hf_newest")]) == 0
    names = {p.name for p in (tmp_path / "hf2").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not names & {"state.json", "trainer_state.pt"}
    ids = torch.tensor([tok.encode("export me")])
    for out, step in (("hf2", 2), ("hf_newest", 4)):
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / out).eval()
        original = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints" / f"step_{step}").eval()
        assert torch.equal(exported(ids).logits, original(ids).logits)
        assert AutoTokenizer.from_pretrained(tmp_path / out).encode("export me") == ids[0].tolist()
    assert not torch.equal(
        AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")(ids).logits,
        AutoModelForCausalLM.from_pretrained(tmp_path / "hf_newest")(ids).logits,
    )

    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint at step 3; steps saved: 2, 4"):
        ckpt.export_checkpoint(tmp_path, tmp_path / "hf3", 3)
    with pytest.raises(FileExistsError, match=r"hf2 exists and is not empty; export into a new or empty folder"):
        ckpt.export_checkpoint(tmp_path, tmp_path / "hf2", 4)


def test_a_full_disk_is_named_with_the_checkpoint_that_is_intact(tmp_path, monkeypatch):
    """torch's writer, out of disk, says only "unexpected pos": the save names the disk, the space
    left and the checkpoint to go back to, and leaves no temporary folder."""
    model = make_model()
    ckpt.save_checkpoint(tmp_path, 2, model.save_pretrained, None, {}, {"data": {}})

    def out_of_disk(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 430596480 vs 430596368")

    monkeypatch.setattr(ckpt.torch, "save", out_of_disk)
    real = shutil.disk_usage
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: real(path)._replace(free=4096))
    with pytest.raises(ckpt.CheckpointSaveError) as err:
        ckpt.save_checkpoint(tmp_path, 4, model.save_pretrained, None, {}, {"data": {}})
    root = tmp_path / "checkpoints"
    assert str(err.value) == (
        f"saving checkpoint {root / 'step_4'}: the disk is full (ENOSPC: 4,096 bytes free); the newest intact "
        f"checkpoint is {root / 'step_2'}; free space there (or lower train.keep_checkpoints) and continue with "
        "--resume"
    )
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]


def test_a_real_full_disk(tmp_path):
    """The same on a 256 KiB tmpfs (a mount namespace of this user's own, where the kernel allows
    one): the model's own writer runs out of space; ENOSPC is named and nothing is left behind."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    small = tmp_path / "small"
    small.mkdir()
    code = (
        "import sys; sys.path.insert(0, 'tests'); from conftest import make_model\n"
        "from tidal.train import checkpoint as c\n"
        "try:\n"
        f"    c.save_checkpoint({str(small)!r}, 1, make_model().save_pretrained, None, {{}}, {{}})\n"
        "except c.CheckpointSaveError as e:\n"
        "    print('REFUSED', e)\n"
        f"import os; print('LEFT', sorted(os.listdir({str(small / 'checkpoints')!r})))\n"
    )
    mount = f'mount -t tmpfs -o size=256k tmpfs {small} && exec {sys.executable} -c "$0"'
    done = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", mount, code], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    if "mount" in done.stderr and done.returncode != 0:
        pytest.skip(f"no user mount namespace here: {done.stderr.strip()[-200:]}")
    refused = [ln for ln in done.stdout.splitlines() if ln.startswith("REFUSED")]
    assert refused and "the disk is full (ENOSPC" in refused[0], done.stdout + done.stderr
    assert "no earlier checkpoint exists" in refused[0]
    assert "LEFT []" in done.stdout  # the temporary folder is gone


def test_a_damaged_file_is_named_before_a_resume_or_an_export_uses_it(tmp_path):
    from tidal.cli import main

    model, tok = make_model(), make_tokenizer()
    folder = ckpt.save_checkpoint(tmp_path, 3, model.save_pretrained, tok, {}, {"data": {}})
    state = json.loads((folder / "state.json").read_text())
    weights = folder / "model.safetensors"
    assert state["files"]["model.safetensors"]["bytes"] == weights.stat().st_size
    ckpt.verify_checkpoint(folder)  # as written: nothing to say

    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit, the same size
    weights.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"model.safetensors: damaged: its CRC-32 differs"):
        ckpt.verify_checkpoint(folder)

    weights.write_bytes(bytes(data[: len(data) // 2]))  # truncated, as by a full disk or a killed copy
    message = f"{weights}: damaged: {len(data) // 2:,} bytes, the checkpoint wrote {len(data):,}"
    with pytest.raises(ckpt.CheckpointError, match=re.escape(message)):
        ckpt.verify_checkpoint(folder)
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "hf")]) == 1
    assert not (tmp_path / "hf").exists()  # nothing copied out

    del state["files"]  # a checkpoint of an older tidal: the safetensors header still tells
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(ckpt.CheckpointError, match=r"model.safetensors: damaged: its tensors need [\d,]+ bytes"):
        ckpt.verify_checkpoint(folder)
