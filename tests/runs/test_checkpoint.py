"""checkpoint.py: sharded checkpoints are read as plain data by every reader and by resume; a
crafted one never runs code, a damaged one is one line naming the file, and --resume auto
passes over it to an older good one."""
import dataclasses
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

import checkpoint as converter
import export_hf
import hellaswag
import sample
from gpt2repro.runs import checkpoint, checkpoint_files, loading, model_weights, optimizer_state
from gpt2repro.training.optimizers import build_optimizer
from helpers import REPO
from helpers.files import EXAMPLES, WritesAFile, declare_bytes, read_metadata, write_jsonl
from helpers.models import make_tiny_gpt, save_as_checkpoint
from helpers.processes import exit_message, one_line_error, run_bounded, run_ranks, said_errors
from helpers.runs import RANK_STOPS, TINY, TINY_CONFIG, assert_same_run, error_of, train
from model import GPT, GPTConfig
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

RUN = ["--total_batch_size", "256", "-B", "8", "--max_steps", "4", "--checkpoint_interval", "2"]


def save_sharded(path, model, optimizer, rest):
    """model's and optimizer's tensors as a sharded checkpoint at path writes them, beside rest."""
    parts = {"model": model_weights.ModelPart(model), "optimizer": checkpoint.OptimizerPart(model, optimizer)}
    checkpoint_files.save_dcp(str(path), {name: part.dcp_state_dict() for name, part in parts.items()}, rest)


def as_sharded(one_file, directory):
    """A one-file checkpoint of train_gpt2.py rewritten as the sharded kind (what --fsdp 1 writes)."""
    state = checkpoint_files.load_checkpoint(str(one_file)).state
    model = GPT(GPTConfig(**state["config"]))
    model.load_state_dict(state["model"])
    optimizer = model.configure_optimizers(0.1, 1e-3, "cpu", fused=False)
    optimizer_state.load_optimizer_state(optimizer, state["optimizer"])
    save_sharded(directory, model, optimizer, {k: v for k, v in state.items() if k not in ("model", "optimizer")})
    return str(directory)


@pytest.fixture(scope="module")
def sharded_run(shards, tmp_path_factory):
    """(records of a 4-step run, its log_dir holding ckpt_000002/ and ckpt_000004/, sharded)."""
    log_dir = tmp_path_factory.mktemp("sharded_run")
    records = train(shards, log_dir, *RUN)
    for step in (2, 4):
        one_file = log_dir / f"ckpt_{step:06d}.pt"
        as_sharded(one_file, log_dir / f"ckpt_{step:06d}")
        os.remove(one_file)
    return records, log_dir


@pytest.fixture
def copy(sharded_run, tmp_path):
    """A fresh copy of the run's log_dir, to damage."""
    shutil.copytree(sharded_run[1], tmp_path / "log")
    return tmp_path / "log"


def stack_global_call(module, name, arg):
    """A protocol-4 pickle that asks module for the (dotted) name and calls it with arg."""
    def text(s):
        b = s.encode()
        return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85R."  # STACK_GLOBAL, TUPLE1, REDUCE


def readers(ckpt, tmp_path):
    """Each script that reads a model, as a call that exits with its one-line error."""
    examples = write_jsonl(tmp_path / "hellaswag.jsonl", EXAMPLES)
    return {
        "checkpoint.py": (converter.main, [ckpt, tmp_path / "out.pt"]),
        "hellaswag.py": (hellaswag.main, ["-m", ckpt, "--data", examples, "--device", "cpu"]),
        "sample.py": (sample.main, ["--model", ckpt, "--device", "cpu", "--max_new_tokens", "1"]),
        "export_hf.py": (export_hf.main, [ckpt, tmp_path / "hf"]),
    }


def assert_every_reader_refuses(ckpt, tmp_path, capsys, expected):
    for script, (main, argv) in readers(ckpt, tmp_path).items():
        message = exit_message(capsys, main, *argv)
        assert message.startswith(f"{script}: error: ") and expected in message, message
        assert str(ckpt) in message, message
    assert not os.path.exists(tmp_path / "out.pt") and not os.path.exists(tmp_path / "hf")


def test_a_dotted_name_in_the_metadata_is_refused_by_every_reader_and_by_resume(copy, shards, tmp_path, capsys):
    """Pickle resolves "os.system" inside DCP's metadata module (its `import os`): a module's
    whole namespace allowed would run it."""
    marker = tmp_path / "ran"
    ckpt = copy / "ckpt_000004"
    (ckpt / ".metadata").write_bytes(stack_global_call("torch.distributed.checkpoint.metadata", "os.system",
                                                       f"touch {marker}"))
    expected = "refused: its .metadata is not DCP's plain metadata (it would construct " \
               "torch.distributed.checkpoint.metadata.os.system); nothing in it was run"
    assert_every_reader_refuses(ckpt, tmp_path, capsys, expected)
    # Resume: passed over with a warning for the older good checkpoint...
    shutil.rmtree(copy / "ckpt_000002")
    # ...and with none, one line.
    message = error_of(capsys, "--data_dir", shards, "--log_dir", copy, *RUN, "--max_steps", "6")
    assert message.startswith(f"error: no checkpoint in {copy} can be read (ckpt_000004)"), message
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "new", *RUN, "--resume", ckpt)
    assert expected in message
    assert not marker.exists()


def test_a_bytes_item_where_a_tensor_belongs_is_refused_before_anything_is_read(copy, tmp_path, capsys):
    marker = tmp_path / "ran"
    ckpt = copy / "ckpt_000004"
    (ckpt / "payload.distcp").write_bytes(pickle.dumps(WritesAFile(str(marker))))
    declare_bytes(ckpt, "model.transformer.wte.weight", ckpt / "payload.distcp")
    expected = "refused: its entry model.transformer.wte.weight is declared plain data where this model holds a tensor"
    assert_every_reader_refuses(ckpt, tmp_path, capsys, expected)
    assert not marker.exists()


def test_plain_data_entries_are_read_with_weights_only(copy, sharded_run, shards, tmp_path, capsys):
    """An entry that is plain data (AdamW's hyperparameters), pointed at a pickle that would run
    code: the conversion and --resume read it, and refuse it."""
    marker = tmp_path / "ran"
    ckpt = copy / "ckpt_000004"
    (ckpt / "payload.distcp").write_bytes(pickle.dumps(WritesAFile(str(marker))))
    declare_bytes(ckpt, "optimizer.param_groups.0.lr", ckpt / "payload.distcp")
    expected = "refused: its entry optimizer.param_groups.0.lr is not plain data"
    assert expected in exit_message(capsys, converter.main, ckpt, tmp_path / "out.pt")
    assert expected in error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "new", *RUN, "--resume", ckpt)
    assert not marker.exists()
    # --resume auto passes over it, with a warning, and trains on from step 2 as if never stopped.
    records = train(shards, copy, *RUN)
    out = capsys.readouterr().out
    assert f"warning: skipping {ckpt}: {expected}" in out and f"resuming from {copy / 'ckpt_000002'} at step 2" in out
    assert_same_run([r for r in sharded_run[0] if r["step"] >= 2], [r for r in records if r["step"] >= 2])
    assert not marker.exists()


def zero(path):
    path.write_bytes(bytes(path.stat().st_size))


def truncate(path):
    path.write_bytes(path.read_bytes()[:1000])


def to_dev_zero(path):
    os.remove(path)
    os.symlink("/dev/zero", path)


STORAGE_FILE = "__0_0.distcp"  # the one that save_dcp writes in one process


@pytest.mark.parametrize("damage, file, expected", [
    (os.remove, STORAGE_FILE, "missing storage file"),
    (zero, STORAGE_FILE, "damaged storage file (UnpicklingError"),
    (truncate, STORAGE_FILE, "truncated or damaged storage file"),
    (to_dev_zero, STORAGE_FILE, "a symbolic link, not a regular file"),
    (to_dev_zero, ".metadata", "a symbolic link, not a regular file"),
    (to_dev_zero, checkpoint_files.TRAIN_STATE, "a symbolic link, not a regular file"),
])
def test_a_damaged_storage_file_is_one_line_in_every_reader_and_skipped_by_resume(copy, sharded_run, shards, tmp_path,
                                                                                  capsys, damage, file, expected):
    ckpt = copy / "ckpt_000004"
    damage(ckpt / file)
    assert_every_reader_refuses(ckpt, tmp_path, capsys, expected)
    records = train(shards, copy, *RUN)
    out = capsys.readouterr()
    assert f"resuming from {copy / 'ckpt_000002'} at step 2" in out.out
    assert f"skipping {ckpt / file}: {expected}" in out.out + out.err
    assert_same_run([r for r in sharded_run[0] if r["step"] >= 2], [r for r in records if r["step"] >= 2])


def test_storage_files_of_another_model_size_and_a_config_of_no_model_are_one_line(copy, tmp_path, capsys):
    ckpt = copy / "ckpt_000004"
    wider = GPT(GPTConfig(**{**TINY_CONFIG, "n_embd": 64}))
    save_sharded(tmp_path / "wider", wider, wider.configure_optimizers(0.1, 1e-3, "cpu"), {})
    for name in (".metadata", STORAGE_FILE):
        shutil.copy(tmp_path / "wider" / name, ckpt / name)
    assert_every_reader_refuses(ckpt, tmp_path, capsys,
                                "refused: its entry model.transformer.wte.weight has shape (256, 64), not this model's "
                                "(256, 32) (another model size)")
    state = checkpoint_files.load_checkpoint(str(copy / "ckpt_000002")).state
    torch.save({**state, "config": {**state["config"], "n_head": 0}}, copy / "ckpt_000002" / checkpoint_files.TRAIN_STATE)
    assert_every_reader_refuses(copy / "ckpt_000002", tmp_path, capsys, "not a checkpoint of this GPT")


def with_dropout(ckpt, dropout):
    """ckpt (sharded) with its config's "dropout" set, or removed (None): checkpoints written while
    GPTConfig had no dropout hold none, or an unused 0.0."""
    state = checkpoint_files.load_checkpoint(str(ckpt)).state
    config = {k: v for k, v in state["config"].items() if k != "dropout"}
    torch.save({**state, "config": config if dropout is None else {**config, "dropout": dropout}},
               ckpt / checkpoint_files.TRAIN_STATE)


def test_older_checkpoints_load_and_a_recorded_dropout_gives_way_to_the_runs(copy, sharded_run, shards, tmp_path,
                                                                             capsys):
    """A checkpoint with no dropout, or 0.0, loads in each reader and resumes as before. One trained at
    0.1 gives the readers a model of dropout 0.1, and a resume
    says in one line that the run's --dropout wins."""
    idx = torch.randint(0, TINY_CONFIG["vocab_size"], (2, 16))
    expected = loading.load_model(str(copy / "ckpt_000004"))(idx)[0]
    with_dropout(copy / "ckpt_000004", None)
    assert torch.equal(loading.load_model(str(copy / "ckpt_000004"))(idx)[0], expected)
    one_file = tmp_path / "one_file.pt"
    converter.main([str(copy / "ckpt_000004"), str(one_file)])
    assert "dropout" not in torch.load(one_file)["config"]  # the record, converted as it is
    assert torch.equal(loading.load_model(str(one_file))(idx)[0], expected)
    with_dropout(copy / "ckpt_000002", None)
    records = train(shards, tmp_path / "resumed", *RUN, "--resume", copy / "ckpt_000002")
    assert_same_run([r for r in sharded_run[0] if r["step"] >= 2], records)
    capsys.readouterr()
    with_dropout(copy / "ckpt_000002", 0.1)
    model = loading.load_model(str(copy / "ckpt_000002"))
    assert model.config.dropout == 0.1
    train(shards, tmp_path / "resumed_at_0", *RUN, "--resume", copy / "ckpt_000002")
    assert (f"note: {copy / 'ckpt_000002'} was trained at --dropout 0.1: resuming at this run's --dropout 0.0"
            in capsys.readouterr().out.splitlines())


def edit_metadata(ckpt, edit):
    """Rewrites ckpt's .metadata as edit(metadata) leaves it: DCP's own classes, lying values."""
    metadata = read_metadata(ckpt)
    edit(metadata)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


WTE = "model.transformer.wte.weight"  # (256, 32), saved as one chunk


def chunk(offsets, sizes):
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


@pytest.mark.parametrize("chunks, problem", [
    ([], "has chunks that leave part of it unread"),
    ([chunk([0, 0], [128, 32]), chunk([64, 0], [128, 32])], "has chunks that overlap"),  # rows 192-255 unread
    ([chunk([0, 0], [256, 32]), chunk([256, 0], [1, 32])], "has a chunk outside it ((1, 32) at (256, 0))"),
])
def test_chunks_that_do_not_tile_a_tensor_are_refused_by_every_reader_and_by_resume(copy, shards, tmp_path, capsys,
                                                                                    chunks, problem):
    """A weight whose chunks leave part of it unread would keep whatever the reader's model held there."""
    ckpt = copy / "ckpt_000004"
    edit_metadata(ckpt, lambda m: setattr(m.state_dict_metadata[WTE], "chunks", chunks))
    expected = f"refused: its entry {WTE} {problem}"
    assert_every_reader_refuses(ckpt, tmp_path, capsys, expected)
    assert expected in error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "new", *RUN, "--resume", ckpt)


def storage_info(metadata):
    return next(iter(metadata.storage_data.values()))


def nested_list(depth):
    """A list that pickles in a few hundred bytes and prints as 2**depth elements."""
    value = []
    for _ in range(depth):
        value = [value, value]
    return value


@pytest.mark.parametrize("edit, expected", [
    (lambda m: setattr(m, "storage_data", None), "damaged (not DCP's metadata)"),
    (lambda m: setattr(storage_info(m), "relative_path", "__0_0.distcp\0"),
     "names '__0_0.distcp\\x00' as a storage file, not a file directly in the directory"),
    (lambda m: setattr(storage_info(m), "relative_path", 7), "names 7 as a storage file, not a file"),
    (lambda m: setattr(storage_info(m), "offset", 10**5000), "bytes at an int in its .metadata"),
])
def test_metadata_values_of_the_wrong_type_are_one_line_in_every_reader(copy, tmp_path, capsys, edit, expected):
    ckpt = copy / "ckpt_000004"
    edit_metadata(ckpt, edit)
    assert_every_reader_refuses(ckpt, tmp_path, capsys, expected)


@pytest.mark.slow
def test_a_metadata_value_endless_to_print_is_refused_at_once(copy, tmp_path):
    """The refusal names it by its type: formatting it would never end, nor its memory stop growing."""
    ckpt = copy / "ckpt_000004"
    edit_metadata(ckpt, lambda m: setattr(storage_info(m), "relative_path", nested_list(60)))
    assert os.path.getsize(ckpt / ".metadata") < 100_000
    message = one_line_error(run_bounded("checkpoint.py", ckpt, tmp_path / "out.pt"))
    assert message == (f"checkpoint.py: error: {ckpt}: refused: its .metadata names a list as a storage file, "
                       f"not a file directly in the directory")


def with_nest(ckpt, field, out):
    """ckpt's contents (either kind) with nested_list(60) as a value of field ("config", "flags", or
    "args": the flags as checkpoints named them before), written as the same kind at out; returns out."""
    state = checkpoint_files.load_checkpoint(str(ckpt)).state
    if field == "args":
        state["args"] = state.pop("flags")
    state[field] = {**state[field], "n_layer": nested_list(60)}
    if os.path.isdir(ckpt):
        shutil.copytree(ckpt, out)
        torch.save(state, os.path.join(out, checkpoint_files.TRAIN_STATE))
    else:
        torch.save(state, out)
    return str(out)


@pytest.mark.slow
@pytest.mark.parametrize("field, depth, kinds", [("config", 1, ("one-file", "sharded")), ("flags", 3, ("sharded",)),
                                                 ("args", 3, ("sharded",))])
def test_a_checkpoint_value_endless_to_print_is_one_line_in_every_reader_and_resume(copy, shards, tmp_path, field,
                                                                                  depth, kinds):
    """A value of the model config or the recorded flags that pickles in a few hundred bytes and
    prints as 2**60 elements: each reader, --init_from and --resume refuse it in one line at once
    (run_bounded: 60 s and 2 GiB at most), one-file and sharded (both read through the same check).
    The flags, which only a resume and a conversion read, are tried there."""
    examples = write_jsonl(tmp_path / "hellaswag.jsonl", EXAMPLES)
    for kind in kinds:
        source = copy / "ckpt_000004"
        if kind == "one-file":
            converter.main([str(source), str(tmp_path / "one_file.pt")])
            source = tmp_path / "one_file.pt"
        ckpt = with_nest(source, field, tmp_path / f"nested_{kind}")
        runs = [("train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", tmp_path / "resumed", *RUN, "--resume", ckpt)]
        if field == "config":
            runs += [("sample.py", "--model", ckpt, "--device", "cpu", "--max_new_tokens", "1"),
                     ("hellaswag.py", "-m", ckpt, "--data", examples, "--device", "cpu"),
                     ("export_hf.py", ckpt, tmp_path / "hf"),
                     ("train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", tmp_path / "init", "--init_from", ckpt)]
        if kind == "sharded":
            runs.append(("checkpoint.py", ckpt, tmp_path / "out.pt"))
        named = os.path.join(ckpt, checkpoint_files.TRAIN_STATE) if kind == "sharded" else ckpt
        for script, *args in runs:
            message = one_line_error(run_bounded(script, *args))
            assert message.endswith(f"{named}: not a checkpoint of this project (its {field} is nested more than "
                                    f"{depth} deep)"), (script, message)
    assert not os.path.exists(tmp_path / "hf") and not os.path.exists(tmp_path / "out.pt")


def test_a_metadata_file_past_its_bound_is_refused_unread(copy, tmp_path, capsys, monkeypatch):
    """The bound (1 GiB) lowered below this checkpoint's .metadata: only as much as the bound is read."""
    from gpt2repro.runs import dcp_reader
    ckpt = copy / "ckpt_000004"
    monkeypatch.setattr(dcp_reader, "MAX_METADATA_BYTES", os.path.getsize(ckpt / ".metadata") - 1)
    assert_every_reader_refuses(ckpt, tmp_path, capsys, f"{ckpt / '.metadata'}: more than ")


@pytest.mark.parametrize("file", [STORAGE_FILE, ".metadata", checkpoint_files.TRAIN_STATE])
def test_a_file_of_a_sharded_checkpoint_that_is_a_link_is_refused_even_to_a_good_one(copy, tmp_path, capsys, file):
    """A link could lead anywhere: followed, the conversion would copy the file it leads to."""
    ckpt = copy / "ckpt_000004"
    shutil.move(ckpt / file, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", ckpt / file)
    assert_every_reader_refuses(ckpt, tmp_path, capsys, f"{ckpt / file}: a symbolic link, not a regular file")


def test_a_model_path_that_is_missing_or_a_device_is_named_as_such():
    with pytest.raises(checkpoint.CheckpointError, match="^/no/such/dir: no such file or directory$"):
        loading.load_model("/no/such/dir")
    with pytest.raises(checkpoint.CheckpointError, match="^/dev/zero: not a regular file or a directory$"):
        loading.load_model("/dev/zero")


@pytest.mark.slow
def test_without_a_network_a_hub_model_is_one_line_at_once(tmp_path):
    """huggingface_hub would retry each file for most of a minute, printing 'Retrying in 8s'."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path))  # port 9 refuses; an empty cache
    result = subprocess.run([sys.executable, os.path.join(REPO, "sample.py"), "--model", "gpt2"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "sample.py: error: cannot load gpt2: it is not in the Hugging Face cache, and 127.0.0.1 cannot be reached "
        "([Errno 111] Connection refused): no network?"]


def stepped_optimizer(model, config):
    """optimizers.build_optimizer(model, config) after one step, so that it holds state to save."""
    from gpt2repro.training.optimizers import build_optimizer
    optimizer = build_optimizer(model, config, "cpu")
    model(torch.arange(16).view(1, 16), torch.arange(1, 17).view(1, 16))[1].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # as on resume: DCP's loader sets up no state for parameters with gradients
    return optimizer


@pytest.mark.parametrize("name, sharded", [("adamw", False), ("adamw", True), ("muon", False), ("muon", True)])
def test_a_resumed_optimizer_takes_this_runs_hyperparameters_and_keeps_what_it_learned(tmp_path, name, sharded):
    """load_state_dict would restore every saved group's settings: weight decay 0.1 would train on
    under --weight_decay 0, and Muon's momentum 0.9 under --muon_momentum 0.5."""
    from gpt2repro.training.optimizers import OptimizerConfig, torch_optimizers
    model = GPT(GPTConfig(**TINY_CONFIG))
    saved = stepped_optimizer(model, OptimizerConfig(name, 1e-3, weight_decay=0.1, muon_lr=0.02, muon_momentum=0.9,
                                                     muon_weight_decay=0.1))
    run = OptimizerConfig(name, 2e-3, weight_decay=0.0, muon_lr=0.05, muon_momentum=0.5, muon_weight_decay=0.0)
    resumed = build_optimizer(model, run, "cpu")
    part = checkpoint.OptimizerPart(model, resumed)
    if sharded:
        save_sharded(tmp_path / "ckpt", model, saved, {})
        checkpoint_files.load_parts(checkpoint_files.ShardedCheckpoint(str(tmp_path / "ckpt"), {}), {"optimizer": part})
    else:
        part.load_state_dict(saved.state_dict())
    adamw = torch_optimizers(resumed)[0]
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.0, 0.0]
    assert all(g["betas"] == (0.9, 0.95) and g["eps"] == 1e-8 for g in adamw.param_groups)
    if name == "muon":
        assert [(g["momentum"], g["weight_decay"], g["lr_scale"]) for g in resumed.muon.param_groups] == [(0.5, 0.0, 25.0)] * 2
    for p, state in saved.state.items():  # the moments and momentum buffers are the saved run's
        for key, value in state.items():
            assert torch.equal(resumed.state[p][key], value), key


def test_the_hyperparameters_that_changed_since_the_checkpoint_are_named_old_to_new():
    record = {"max_lr": 6e-4, "weight_decay": 0.1, "muon_momentum": 0.9, "warmup_steps": 10, "log_dir": "a",
              "decay_steps": [[]] * 3}
    run = {**record, "weight_decay": 0.0, "muon_momentum": 0.5, "log_dir": "b", "decay_steps": 100, "muon_lr": 0.02}
    assert checkpoint.changed_hyperparameters(record, run) == [
        "decay_steps a list -> 100", "weight_decay 0.1 -> 0.0", "muon_momentum 0.9 -> 0.5"]
    assert checkpoint.changed_hyperparameters(None, run) == [] and checkpoint.changed_hyperparameters(record, record) == []


def test_a_resume_under_another_seq_len_or_seed_says_what_that_changes():
    record = {"seq_len": 1024, "seed": 1337, "shuffle": 1, "max_lr": 6e-4}
    assert checkpoint.changed_inputs(record, record, epoch=3) == [] and checkpoint.changed_inputs(None, record, 0) == []
    assert checkpoint.changed_inputs(record, {**record, "seq_len": 512}, epoch=0) == [
        "this run's -T wins over the checkpoint's (1024 -> 512): the model trains on sequences of 512 tokens from "
        "here, cut from the data at other places; its val loss, over such sequences too, is not comparable with the "
        "one before"]
    reseeded = {**record, "seed": 7}
    said = [checkpoint.changed_inputs(record, run, epoch) for run, epoch in
            [(reseeded, 0), (reseeded, 2), ({**reseeded, "shuffle": 0}, 2)]]
    assert said == [[f"this run's --seed wins over the checkpoint's (1337 -> 7): {order}, and the samples differ"]
                    for order in ["the epochs after the first, which it shuffles, are read in another order",
                                  "this epoch and the later ones, which it shuffles, are read in another order: some "
                                  "of this epoch's sequences are read twice, others not at all",
                                  "the data is read in file order all the same (--shuffle 0)"]]
    assert checkpoint.changed_inputs({**record, "seed": [[]] * 3}, record, epoch=0)[0].startswith(
        "this run's --seed wins over the checkpoint's (a list -> 1337)")


def cpu_state(data):
    """A CPU random state of these bytes (uint8)."""
    return {"cpu": torch.tensor(data, dtype=torch.uint8), "cuda": []}


# Random states a checkpoint's "rng" cannot be restored from, and the problem named: a rank's
# state too short, a string, 100 bytes, of the right size but no generator's, and a string
# where the list of every rank's belongs (list("abc") would be three ranks').
BAD_RNG = [
    pytest.param(lambda good: [good, cpu_state(list(good["cpu"][:-8]))],
                 "rank 1's CPU state: Expected a CPUGeneratorImplState of size 5056 but found the input RNG state size "
                 "to be 5048", id="too short"),
    pytest.param(lambda good: [good, "abc"], "rank 1's state is 'abc', not a dict of the CPU's state and a list of "
                                            "the GPUs'", id="a string"),
    pytest.param(lambda good: [good, cpu_state(range(100))], "rank 1's CPU state: Expected a CPUGeneratorImplState of "
                                                             "size 5056 but found the input RNG state size to be 100",
                 id="100 bytes"),
    pytest.param(lambda good: [good, cpu_state([0] * 5056)], "rank 1's CPU state: Invalid mt19937 state",
                 id="no generator's"),
    pytest.param(lambda good: [good, {"cpu": good["cpu"], "cuda": [torch.zeros(3)]}],
                 "rank 1's CUDA states are not 16 bytes each", id="cuda"),
    pytest.param(lambda good: "abc", "it is 'abc', not a list of one random state per rank", id="rng a string"),
]


@pytest.mark.parametrize("bad, problem", BAD_RNG)
def test_random_states_that_cannot_be_restored_are_one_line_naming_the_rank(bad, problem):
    """Every rank's state is checked, whichever rank restores it, and this one's stays as it was."""
    before = torch.get_rng_state()
    saved = bad(checkpoint.random_state())
    for dropout in (0.0, 0.1):
        with pytest.raises(checkpoint.CheckpointError) as e, checkpoint_files.restoring("ckpt_000004.pt", "rng"):
            checkpoint.RandomStates(dropout).load_state_dict(saved)
        assert str(e.value) == f"ckpt_000004.pt: its rng cannot be restored ({problem})"
        assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.slow
@pytest.mark.parametrize("scale, kind, case", [([], "one-file", 0), (["--fsdp", "1"], "sharded", 1),
                                               ([], "sharded", 2), (["--fsdp", "1"], "one-file", 3)],
                         ids=["ddp-one-file", "fsdp-sharded", "ddp-sharded", "fsdp-one-file"])
def test_a_bad_random_state_of_one_rank_stops_every_rank_with_one_line(copy, shards, tmp_path, scale, kind, case):
    """Resumed on 2 ranks, a checkpoint whose rank-1 random state cannot be restored: every rank
    stops with the same line, said once, and none is left waiting (the run ends within the timeout)."""
    bad, problem = BAD_RNG[case].values
    one_file = tmp_path / "ckpt_000004.pt"
    converter.main([str(copy / "ckpt_000004"), str(one_file)])
    state = torch.load(one_file)
    torch.save({**state, "rng": bad(state["rng"][0])}, one_file)
    ckpt = as_sharded(one_file, tmp_path / "ckpt_000004") if kind == "sharded" else one_file
    script = tmp_path / "rank_stops.py"
    script.write_text(RANK_STOPS.format(repo=REPO))
    result = run_ranks(script, *TINY, *RUN, "-B", "4", "--max_steps", "6", *scale, "--data_dir", shards,
                       "--log_dir", tmp_path / "log", "--resume", ckpt, timeout=120)
    expected = f"{ckpt}: its rng cannot be restored ({problem})"
    assert result.returncode != 0 and "resuming from" not in result.stdout
    assert sorted(line for line in result.stdout.splitlines() if "stops:" in line) == [
        f"rank 0 stops: {expected}", f"rank 1 stops: {expected}"], result.stdout[-3000:]
    assert said_errors(result.stderr) == [f"error: {expected}"] and [rank.returncode for rank in result.ranks] == [1, 1]


@pytest.mark.parametrize("row, where", [
    (50300, ", only in rows 50257-50303, which pad the vocabulary and which no token id reaches"),
    (50256, ""),  # <|endoftext|>'s row: a token reaches it
])
def test_non_finite_weights_are_refused_naming_the_padding_rows_when_only_they_hold_them(tmp_path, row, where):
    model = make_tiny_gpt()
    with torch.no_grad():
        model.transformer.wte.weight[row, 3] = float("nan")
    path = save_as_checkpoint(model, tmp_path / "ckpt_000010.pt")
    with pytest.raises(checkpoint.CheckpointError) as e:
        loading.load_model(path)
    assert str(e.value) == f"{path}: transformer.wte.weight holds NaN or infinite values{where}: no model to use"


def tampered(optimizer, name, key, change):
    """optimizer with change(value) in place of its state's key of the parameter name (every
    parameter's, for name None)."""
    from gpt2repro.training.optimizers import torch_optimizers
    for part in torch_optimizers(optimizer):
        for param, state in part.state.items():
            if key in state and (name is None or param is name):
                state[key] = change(state[key])
    return optimizer


def bool_tensor(value):
    return value > 0


@pytest.mark.parametrize("kind, key, change, every, one_file, sharded", [
    ("adamw", "exp_avg", bool_tensor, False, "exp_avg is torch.bool, not its parameter's torch.float32",
     "is declared torch.bool, where this model holds torch.float32"),
    ("adamw", "step", lambda step: torch.tensor(True), True, "step is torch.bool, not a count",
     "is declared torch.bool, where this model holds torch.float32"),
    ("adamw", "exp_avg_sq", torch.neg, False, "exp_avg_sq holds negative values: a mean of squares is 0 or more", None),
    ("muon", "momentum_buffer", bool_tensor, False,
     "momentum_buffer is torch.bool, not its parameter's torch.float32",
     "is declared torch.bool, where this model holds torch.float32"),
])
def test_crafted_optimizer_states_are_refused_in_one_line_naming_the_checkpoint_and_the_part(
        tmp_path, kind, key, change, every, one_file, sharded):
    """Moments or a momentum buffer of another dtype (torch's load would cast a bool's to 0s and 1s
    and train on), a negative mean of squares, a step counter that is a bool: each format refuses
    them, as the trainer's resume reads them (OptimizerPart), naming the parameter or the entry."""
    from gpt2repro.training.optimizers import OptimizerConfig, muon_params
    model = GPT(GPTConfig(**TINY_CONFIG))
    param = muon_params(model)[0] if kind == "muon" else model.transformer.wte.weight
    name = "transformer.h.0.attn.c_attn.weight" if kind == "muon" else "transformer.wte.weight"
    config = OptimizerConfig(kind, 1e-3, 0.1)
    saved = tampered(stepped_optimizer(model, config), None if every else param, key, change)
    part = checkpoint.OptimizerPart(model, build_optimizer(model, config, "cpu"))
    with pytest.raises(checkpoint.CheckpointError) as e, checkpoint_files.restoring("ckpt_000004.pt", "optimizer"):
        part.load_state_dict(saved.state_dict())
    assert str(e.value) == f"ckpt_000004.pt: its optimizer cannot be restored (the state of {name}: {one_file})"
    save_sharded(tmp_path / "ckpt", model, saved, {})
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint_files.load_parts(checkpoint_files.ShardedCheckpoint(str(tmp_path / "ckpt"), {}), {"optimizer": part})
    expected = (f"{tmp_path / 'ckpt'}: refused: its entry optimizer.state.{name}.{key} {sharded}; nothing was read"
                if sharded else f"{tmp_path / 'ckpt'}: its optimizer cannot be restored (the state of {name}: {one_file})")
    assert str(e.value) == expected


def store_instead(ckpt, key, tensor):
    """ckpt (sharded) with the entry key's piece pointed at tensor, stored after the rest of its
    storage file: its .metadata still declares what train_gpt2.py stored there."""
    import io
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def edit(metadata):
        index = next(i for i in metadata.storage_data if i.fqn == key)
        file = ckpt / metadata.storage_data[index].relative_path
        data = io.BytesIO()
        torch.save(tensor, data)
        metadata.storage_data[index] = _StorageInfo(file.name, file.stat().st_size, len(data.getvalue()))
        with open(file, "ab") as f:
            f.write(data.getvalue())
    edit_metadata(ckpt, edit)


def test_a_piece_stored_in_another_dtype_than_it_is_read_into_is_refused(copy, shards, tmp_path, capsys):
    """Read into the model's float32 tensors, a bool piece would be cast to 0s and 1s."""
    ckpt = copy / "ckpt_000004"
    store_instead(ckpt, WTE, torch.ones(256, 32, dtype=torch.bool))
    assert_every_reader_refuses(ckpt, tmp_path, capsys, f"{ckpt / STORAGE_FILE}: refused: it stores {WTE} as "
                                                        f"torch.bool, where this model holds torch.float32")
    key = "optimizer.state.transformer.wte.weight.exp_avg"
    store_instead(copy / "ckpt_000002", key, torch.ones(256, 32, dtype=torch.bool))
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "new", *RUN, "--resume",
                       copy / "ckpt_000002")
    assert message == (f"error: {copy / 'ckpt_000002' / STORAGE_FILE}: refused: it stores {key} as torch.bool, where "
                       f"this model holds torch.float32")


def pointed_at(entry, target, shift):
    """A .metadata edit: entry's piece placed shift bytes into target's."""
    def edit(metadata):
        index = {i.fqn: i for i in metadata.storage_data}
        stored = metadata.storage_data[index[target]]
        metadata.storage_data[index[entry]] = dataclasses.replace(stored, offset=stored.offset + shift)
    return edit


@pytest.mark.parametrize("shift", [0, 1000], ids=["the same bytes", "bytes within them"])
def test_a_piece_placed_in_another_pieces_bytes_is_refused_by_every_reader_and_by_resume(copy, shards, tmp_path, capsys,
                                                                                         shift):
    """The position embedding read from the token embedding's bytes: DCP stores each piece apart."""
    ckpt = copy / "ckpt_000004"
    edit_metadata(ckpt, pointed_at("model.transformer.wpe.weight", WTE, shift))
    at = read_metadata(ckpt).storage_data
    offset = next(info.offset for index, info in at.items() if index.fqn == "model.transformer.wpe.weight")
    expected = (f"{ckpt / STORAGE_FILE}: refused: its .metadata places 'model.transformer.wpe.weight' in bytes of "
                f"'{WTE}' (at {offset:,}): each piece is stored apart")
    assert_every_reader_refuses(ckpt, tmp_path, capsys, expected)
    assert error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "new", *RUN, "--resume", ckpt) == \
        f"error: {expected}"


def edited_state(ckpt, edit, out):
    """ckpt's train_state.pt (sharded) or contents (one file) as edit(state) leaves them, written as
    the same kind at out; returns out."""
    state = checkpoint_files.load_checkpoint(str(ckpt)).state
    edit(state)
    if os.path.isdir(ckpt):
        shutil.copytree(ckpt, out)
        torch.save(state, os.path.join(out, checkpoint_files.TRAIN_STATE))
    else:
        torch.save(state, out)
    return out


@pytest.mark.parametrize("position, problem", [
    ({"index": -3}, "its index is -3, of 256 tokens each: a position outside this run's shards (36,222 tokens)"),
    ({"index": 10**9}, "its index is 1000000000, of 256 tokens each: a position outside this run's shards "
                       "(36,222 tokens)"),
    ({"tokens_per_index": 0}, "its tokens_per_index is 0, not 1 to 36,222, what this run's shards hold"),
    ({"tokens_per_index": -256}, "its tokens_per_index is -256, not 1 to 36,222, what this run's shards hold"),
    ({"epoch": -1}, "its epoch is -1, not a count of 0 or more below 2**63"),
    ({"epoch": float("inf")}, "its epoch is inf, not an integer"),
    ({"index": True}, "its index is True, not an integer"),
])
@pytest.mark.parametrize("kind", ["one-file", "sharded"])
def test_a_loader_position_its_shards_never_reach_is_refused_naming_the_checkpoint(copy, shards, tmp_path, capsys,
                                                                                   kind, position, problem):
    """The train loader's epoch, index and tokens per index, crafted: once trained on from a
    position before or past the shards, or an epoch of inf (an OverflowError traceback)."""
    ckpt = copy / "ckpt_000002"
    if kind == "one-file":
        converter.main([str(ckpt), str(tmp_path / "one_file.pt")])
        ckpt = tmp_path / "one_file.pt"
    edited = edited_state(ckpt, lambda state: state["train_loader"].update(position), tmp_path / "edited")
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "new", *RUN, "--resume", edited)
    assert message == f"error: {edited}: its train_loader cannot be restored ({problem})"


@pytest.mark.parametrize("row, where", [
    (50300, ", only in rows 50257-50303, which pad the vocabulary and which no token id reaches"),
    (3, ""),  # a row that token 3 reads: the loss is NaN from the first step
])
@pytest.mark.parametrize("kind", ["one-file", "sharded"])
def test_a_resumed_model_that_is_not_finite_is_refused_at_load_as_the_scripts_refuse_it(tmp_path, kind, row, where):
    """As load_model names it for sample.py, export_hf.py, hellaswag.py and --init_from: a resume
    would train on to a save ("the weights at step N are not finite") or an evaluation ("the val
    loss ... is nan"), naming neither the checkpoint nor the weight."""
    saved = make_tiny_gpt()
    with torch.no_grad():
        saved.transformer.wte.weight[row, 3] = float("nan")
    part = model_weights.ModelPart(make_tiny_gpt(seed=1))
    path = tmp_path / "ckpt_000004"
    if kind == "one-file":
        with pytest.raises(checkpoint.CheckpointError) as e, checkpoint_files.restoring(str(path), "model"):
            part.load_state_dict(saved.state_dict())
    else:
        save_sharded(path, saved, saved.configure_optimizers(0.1, 1e-3, "cpu"), {})
        with pytest.raises(checkpoint.CheckpointError) as e:
            checkpoint_files.load_parts(checkpoint_files.ShardedCheckpoint(str(path), {}), {"model": part})
    assert str(e.value) == f"{path}: its model cannot be restored (transformer.wte.weight holds NaN or infinite values" \
                           f"{where})"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["one-file", "sharded"])
def test_a_resumed_model_that_is_not_finite_stops_every_fsdp_rank_with_one_line(copy, shards, tmp_path, kind):
    """Under FSDP each rank holds a slice of the weights: the one that holds the NaN, and the other, stop alike."""
    one_file = tmp_path / "ckpt_000004.pt"
    converter.main([str(copy / "ckpt_000004"), str(one_file)])
    state = torch.load(one_file)
    state["model"]["transformer.wte.weight"][200, 3] = float("nan")  # rank 1's rows of 256
    torch.save(state, one_file)
    ckpt = as_sharded(one_file, tmp_path / "ckpt_000004") if kind == "sharded" else one_file
    script = tmp_path / "rank_stops.py"
    script.write_text(RANK_STOPS.format(repo=REPO))
    result = run_ranks(script, *TINY, *RUN, "-B", "4", "--max_steps", "6", "--fsdp", "1", "--data_dir", shards,
                       "--log_dir", tmp_path / "log", "--resume", ckpt, timeout=120)
    expected = f"{ckpt}: its model cannot be restored (transformer.wte.weight holds NaN or infinite values)"
    assert sorted(line for line in result.stdout.splitlines() if "stops:" in line) == [
        f"rank 0 stops: {expected}", f"rank 1 stops: {expected}"], result.stdout[-3000:] + result.stderr[-3000:]
    assert said_errors(result.stderr) == [f"error: {expected}"]


def test_a_config_that_lacks_a_field_names_it_in_every_reader_and_resume(copy, shards, tmp_path, capsys):
    """GPTConfig's default would stand in for it (12 layers) and fail later, or a resume say
    "another architecture: ;" naming nothing."""
    ckpt = edited_state(copy / "ckpt_000004", lambda state: state["config"].pop("n_layer"), tmp_path / "no_n_layer")
    expected = f"{ckpt}: not a checkpoint of this GPT (its config lacks GPTConfig's field n_layer)"
    assert_every_reader_refuses(ckpt, tmp_path, capsys, expected)
    assert error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "new", *RUN, "--resume", ckpt) == \
        f"error: {expected}"


def test_the_conversion_writes_the_flags_that_readers_read_not_an_older_args_beside_them(copy, tmp_path):
    flags = checkpoint.recorded_flags(checkpoint_files.load_checkpoint(str(copy / "ckpt_000004")).state)
    ckpt = edited_state(copy / "ckpt_000004", lambda state: state.update(args={**flags, "max_lr": 1.0}),
                        tmp_path / "both")
    converter.main([str(ckpt), str(tmp_path / "out.pt")])
    converted = checkpoint_files.load_checkpoint(str(tmp_path / "out.pt")).state
    assert converted["flags"] == flags and "args" not in converted


def test_the_conversion_replaces_an_existing_file_only_with_force(copy, tmp_path, capsys):
    out = tmp_path / "ckpt_000004.pt"
    out.write_bytes(b"a checkpoint of the user's")
    assert exit_message(capsys, converter.main, copy / "ckpt_000004", out) == \
        f"checkpoint.py: error: {out} exists (use --force to replace it)"
    assert out.read_bytes() == b"a checkpoint of the user's"
    converter.main([str(copy / "ckpt_000004"), str(out), "--force"])
    assert checkpoint_files.load_checkpoint(str(out)).state["step"] == 4
