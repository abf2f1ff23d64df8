"""cli.py: config files of flag values (the trainer's presets and --config), read as plain data
and checked against the flags, each problem one line naming the file and the key."""
import argparse
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

import train_gpt2
from gpt2repro.common import cli
from gpt2repro.common.cli import MAX_CONFIG_BYTES, preset_names
from gpt2repro.training import train_config
from helpers import REPO
from helpers.processes import exit_message, one_line_error, run_bounded
from helpers.runs import error_of


def write(path, text):
    path.write_text(text)
    return str(path)


def test_a_config_sets_defaults_that_flags_override(tmp_path):
    config = write(tmp_path / "run.toml", 'n_layer = 3\nmax_lr = 1\ndevice = "cpu"\nplan = true\nlog_dir = "x"\n')
    cfg = train_gpt2.parse_args(["--preset", "demo", "--config", config, "--log_dir", "y"])
    assert (cfg.model.n_layer, cfg.optimizer.max_lr, cfg.runtime.device, cfg.plan, cfg.log_dir) == (3, 1.0, "cpu", True, "y")
    assert isinstance(cfg.optimizer.max_lr, float)
    assert cfg.model.n_embd == 128 and cfg.data_dir == os.path.join(REPO, "data", "shakespeare")  # the preset's


@pytest.mark.parametrize("text, expected", [
    ("compile = 0\nhellaswag = false\nfsdp = true", ("0", 0, 1)),
    ("compile = true\nhellaswag = 0\nfsdp = false", ("1", 0, 0)),
    ("compile = 'auto'", ("auto", 1, 0)),
])
def test_a_switch_in_a_config_takes_tomls_true_false_1_and_0(tmp_path, text, expected):
    cfg = train_gpt2.parse_args(["--config", write(tmp_path / "run.toml", text)])
    assert (cfg.runtime.compile, cfg.eval.hellaswag, cfg.scale.fsdp) == expected
    assert type(cfg.eval.hellaswag) is int and type(cfg.runtime.compile) is str


@pytest.mark.parametrize("argv, here", [
    (["--batch_size", "12"], "-B/--micro_batch_size"),  # nanoGPT's flags, in its configurator's form too
    (["--learning_rate=6e-4"], "--max_lr"),
    (["--eval_iters=200", "--max_iters", "10"], "--val_steps"),
    (["--eval_only=True"], "--max_steps 0"),
    (["--gradient_accumulation_steps=40"], "--total_batch_size"),
    (["--min_lr", "6e-5"], "--min_lr_ratio"),  # nanoGPT's and build-nanogpt's
    (["--use_compile"], "--compile"),  # build-nanogpt's setting
])
def test_nanogpts_and_build_nanogpts_names_for_a_flag_point_to_its_name_here(tmp_path, capsys, argv, here):
    """On the command line or in a config file: one usage error naming this trainer's flag."""
    name = argv[0].split("=")[0]
    whose = train_config.OTHER_PROJECTS_FLAGS[name[2:]][0]
    config = write(tmp_path / "theirs.toml", f"{name[2:]} = 1\n")
    for args, where in ((argv, ""), (["--config", config], f"{config}: {name[2:]}: ")):
        with pytest.raises(SystemExit) as exit_info:
            train_gpt2.parse_args(args)
        message = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and "\n" not in message, message
        assert f"error: {where}{name} is {whose} name; here it is {here}" in message, message


def test_each_pointer_to_a_flag_here_names_one_the_trainer_takes():
    parser = train_config.build_parser()
    for name, (_, instead) in train_config.OTHER_PROJECTS_FLAGS.items():
        named = re.match(r"(-\S+?)(,|\s|$)", instead).group(1).split("/")
        taken = [flag for flag in named if flag in parser._option_string_actions
                 and not isinstance(parser._option_string_actions[flag], cli.Retired)]
        assert taken == named, name


def test_every_preset_is_a_valid_config():
    for name in preset_names():
        assert train_gpt2.parse_args(["--preset", name]).preset == name


def test_the_typed_config_holds_every_flag_and_gives_each_back():
    """TrainConfig has a field for every flag of the trainer, each value the one parsed: a flag
    added to the parser but not to the config (or the other way round) fails here."""
    dests = [a.dest for a in train_config.build_parser()._actions
             if a.option_strings and a.dest != "help" and not isinstance(a, cli.Retired)]
    argv = ["--n_layer", "3", "-B", "5", "--max_lr", "0.5", "--muon_lr", "0.25", "--val_steps", "7", "--keep_last", "2",
            "--recompute", "attn", "--attention", "math", "--fault", "nan@3:1", "--hellaswag_path", "h.jsonl"]
    cfg = train_gpt2.parse_args(argv)
    flags = cfg.flags()
    assert sorted(flags) == sorted(dests)
    assert train_gpt2.TrainConfig.from_flags(flags) == cfg
    assert (cfg.model.n_layer, cfg.batch.micro_batch_size, cfg.optimizer.max_lr) == (3, 5, 0.5)
    assert (cfg.optimizer.muon_lr, cfg.eval.val_steps, cfg.checkpoints.keep_last, cfg.scale.recompute) == \
        (0.25, 7, 2, "attn")
    assert (cfg.runtime.attention, cfg.runtime.fault, cfg.eval.hellaswag_path) == ("math", [("nan", 3, 1)], "h.jsonl")
    assert cfg.schedule.decay_steps == cfg.schedule.max_steps == 19073  # --decay_steps' None


def test_the_default_config_is_the_124m_recipe_with_each_setting_declared_once():
    """TrainConfig() is what the trainer runs with no flags; each flag is one field of one part."""
    cfg = train_config.TrainConfig()
    assert train_gpt2.parse_args([]) == cfg
    names = [train_config.flag_name(f) for f, _ in train_config.flag_values(cfg)]
    assert len(names) == len(set(names)) == len(cfg.flags())
    assert (cfg.optimizer.max_lr, cfg.schedule.lr(714, cfg.optimizer.max_lr), cfg.batch.micro_batch_size) == (6e-4, 6e-4, "auto")
    assert cfg.batch.auto_micro_batches(1)[0] == 64  # -B auto's ceiling: the recipe's micro-batch


@pytest.mark.parametrize("flags, expected", [
    (["--decay_steps", "-1"], "--decay_steps must not be negative, not -1"),
    (["--min_lr_ratio", "1.5"], "--min_lr_ratio must be in [0, 1], not 1.5"),
    (["--max_lr", "0"], "--max_lr must be positive, not 0.0"),
    (["--max_lr", "1e300"], "--max_lr 1e+300 is past float32's range, in which the optimizer steps"),
    (["--optimizer", "muon", "--muon_momentum", "1"], "--muon_momentum must be in [0, 1), not 1.0"),
    (["--recompute_every", "0"], "--recompute_every must be positive, not 0"),
    (["--checkpoint_interval", "-2"], "--checkpoint_interval must be -1 (never), 0 (at the end) or more, not -2"),
    (["--val_steps", "0"], "--val_steps must be positive, not 0"),
    (["--async_checkpoint"], "--async_checkpoint writes sharded checkpoints: it needs --fsdp 1"),
])
def test_a_value_its_parts_check_refuses_is_a_usage_error_naming_the_flag(capsys, flags, expected):
    """Each part of the config checks its own fields (__post_init__), before anything is built."""
    with pytest.raises(SystemExit) as exit_info:
        train_gpt2.parse_args(flags)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith(f": error: {expected} (see --help)\n")


@pytest.mark.parametrize("flags, expected", [(["--n_layer", "0"], "--n_layer must be a positive integer, not 0"),
                                             (["--n_head", "5"], "--n_head 5 does not divide n_embd 768")])
def test_model_sizes_no_gpt_can_have_are_refused_by_gptconfigs_own_check(capsys, flags, expected):
    assert exit_message(capsys, train_gpt2.parse_args, *flags).endswith(f": error: {expected} (see --help)")


@pytest.mark.parametrize("text, expected", [
    ("n_layers = 3", "unknown key 'n_layers' (not one of the flags' long names)"),
    ("preset = 'demo'", "unknown key 'preset'"),
    ("n_layer = '12'", "n_layer must be an integer, not '12'"),
    ("n_layer = 1.5", "n_layer must be an integer, not 1.5"),
    ("n_layer = true", "n_layer must be an integer, not True"),
    ("max_lr = 'high'", "max_lr must be a number, not 'high'"),
    ("device = 1", "device must be a string, not 1"),
    ("plan = 1", "plan must be true or false, not 1"),
    ("compile = 2", "compile must be a string, not 2"),
    ("dtype = 'float64'", "dtype must be one of auto, bfloat16, float16, float32, not 'float64'"),
    ("fault = ['nan@1']", "fault cannot be set in a config file"),
    ("n_layer = ", "not TOML"),
    pytest.param("max_lr = " + "9" * 400, "max_lr is too large for a float", id="400 digits"),
    pytest.param("max_lr = " + "[" * 4000 + "]" * 4000, "not TOML (maximum recursion depth exceeded", id="deep array"),
    pytest.param("max_lr = " + "{a = " * 4000 + "1" + "}" * 4000, "not TOML (maximum recursion depth exceeded",
                 id="deep inline table"),
    pytest.param("max_lr" + ".a" * 4000 + " = 1", "max_lr must be a number, not a dict",  # its repr: 4000 deep
                 id="deep dotted key"),
    ('log_dir = "log\\u0000x"', "log_dir must not hold a NUL character"),
    pytest.param("n_layer = '" + "x" * 1000 + "'", "n_layer must be an integer, not 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
                 "xxxxxxxx'... (1,000 characters)", id="long string"),
    pytest.param("micro_batch_size = '" + "x" * 1000 + "'", "micro_batch_size must be what --micro_batch_size takes: "
                 "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... (1,000 characters) is neither", id="long -B"),
    pytest.param("data_dir = '" + "x" * 900_000 + "'", "data_dir is 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... "
                 "(900,000 characters), longer than any flag's value (4,096 characters at most)",
                 id="900,000 characters"),
    pytest.param("'" + "k" * 900_000 + "' = 1", "unknown key 'kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk'... "
                 "(900,000 characters)", id="900,000-character key"),
])
def test_a_bad_config_is_one_line_naming_the_file_and_key(tmp_path, capsys, text, expected):
    """A value is echoed as brief text: never 900,000 characters of it."""
    config = write(tmp_path / "run.toml", text)
    message = exit_message(capsys, train_gpt2.main, "--config", config)
    assert message.split(": error: ", 1)[1].startswith(f"{config}: {expected}"), message
    assert len(message) < 300 + len(str(config))


def test_a_config_that_is_missing_or_not_a_file_is_one_line(tmp_path, capsys):
    message = exit_message(capsys, train_gpt2.main, "--config", tmp_path / "none.toml")
    assert message.endswith(f": error: {tmp_path / 'none.toml'}: cannot read it (No such file or directory) (see --help)")
    os.mkfifo(tmp_path / "fifo.toml")
    message = exit_message(capsys, train_gpt2.main, "--config", tmp_path / "fifo.toml")
    assert message.endswith(f": error: {tmp_path / 'fifo.toml'}: a FIFO, not a regular file (see --help)")


def test_help_lists_each_part_of_the_config_as_a_group_of_its_flags(capsys):
    with pytest.raises(SystemExit):
        train_gpt2.main(["--help"])
    out = capsys.readouterr().out
    groups = re.findall(r"^(\w+):\n  (.*)\n", out, re.M)
    assert [name for name, _ in groups] == ["options", "model", "batch", "schedule", "optimizer", "eval", "checkpoints",
                                            "scale", "runtime"]
    runtime = out.split("\nruntime:\n")[1]
    assert "--fault KIND@STEP[:RANK]" in runtime and "--micro_batch_size" not in runtime


class Captured(Exception):
    pass


SCRIPTS = ["train_gpt2", "fineweb", "hellaswag", "sample", "export_hf", "plot_log", "bench", "checkpoint"]


def script_parser(script, monkeypatch):
    """The parser that script's main() builds, caught as it parses: every script's is a cli.Parser."""
    import importlib

    from gpt2repro.common import cli
    parsers = []

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        raise Captured
    monkeypatch.setattr(cli.Parser, "parse_args", capture)
    main = getattr(importlib.import_module(script), "main")
    with pytest.raises(Captured):
        main(["--help"])
    monkeypatch.undo()
    return parsers[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_scripts_help_says_what_each_flag_does_and_its_default(script, monkeypatch):
    """Every flag has help text, and --help shows its default (cli.HelpWithDefaults) unless it has none."""
    from gpt2repro.common import cli
    parser = script_parser(script, monkeypatch)
    assert isinstance(parser.formatter_class(prog="x"), cli.HelpWithDefaults)
    missing = [action.option_strings or action.dest for action in parser._actions if not action.help]
    assert not missing, missing
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.default not in (None, argparse.SUPPRESS) and action.help:
            shown = formatter._get_help_string(action)
            assert "%(default)s" in shown or "(default:" in shown, action.dest
            assert shown.replace("%(default)s", "").count("(default") == 1, f"{action.dest}: its default shown twice"


def test_a_config_file_too_large_is_one_line(tmp_path, capsys):
    with open(tmp_path / "huge.toml", "wb") as f:
        f.truncate(6 << 30)  # sparse: it takes no disk
    message = exit_message(capsys, train_gpt2.main, "--config", tmp_path / "huge.toml")
    assert message.endswith(f"{tmp_path / 'huge.toml'}: more than {MAX_CONFIG_BYTES:,} bytes: not a config file (see --help)")


@pytest.mark.parametrize("flag", ["max_lr", "muon_lr", "weight_decay", "muon_weight_decay"])
def test_an_infinite_rate_or_decay_is_refused_from_a_flag_or_a_file(tmp_path, capsys, flag):
    """inf would train on, and stop only at the end, its weights not finite."""
    flags = ["--optimizer", "muon", "--max_steps", "1", "--data_dir", tmp_path / "no_data"]
    assert error_of(capsys, *flags, f"--{flag}", "inf").endswith(f": error: --{flag} must be a finite number, not inf "
                                                                 f"(see --help)")
    config = write(tmp_path / "run.toml", f"{flag} = inf")
    assert f"--{flag} must be a finite number, not inf" in exit_message(capsys, train_gpt2.main, "--config", config)


# Every preset but gpt2, and a broken and a FIFO one: only the preset asked for is read.
PRESETS_AS_ASKED = """
import os, sys
sys.path.insert(0, {repo!r})
from gpt2repro.common import cli
cli.CONFIG_DIR = {configs!r}
import train_gpt2
train_gpt2.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_only_the_preset_asked_for_is_read(tmp_path):
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "gpt2.toml").write_text(open(os.path.join(REPO, "configs", "gpt2.toml")).read())
    (configs / "broken.toml").write_text("n_layer = ")
    os.mkfifo(configs / "fifo.toml")
    script = write(tmp_path / "presets.py", PRESETS_AS_ASKED.format(repo=REPO, configs=str(configs)))
    result = run_bounded(script, "--preset", "gpt2", "--plan")
    assert result.returncode == 0 and "124,475,904 parameters" in result.stdout, result.stderr
    assert one_line_error(run_bounded(script, "--preset", "broken")).startswith(
        f"presets.py: error: {configs / 'broken.toml'}: not TOML")
    assert one_line_error(run_bounded(script, "--preset", "fifo")).startswith(
        f"presets.py: error: {configs / 'fifo.toml'}: a FIFO, not a regular file")


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_script_takes_an_abbreviated_flag(script, monkeypatch):
    parser = script_parser(script, monkeypatch)
    positionals = ["x"] * sum(1 for action in parser._actions if not action.option_strings)
    for action in parser._actions:
        flag = max(action.option_strings, key=len, default="")
        abbreviation = flag[:-1]
        if len(flag) > 3 and flag != "--help" and abbreviation not in parser._option_string_actions:
            _, unknown = parser.parse_known_args(positionals + [abbreviation] + ["1"] * (action.nargs != 0))
            assert abbreviation in unknown, flag


def test_the_trainer_refuses_an_abbreviated_flag_in_one_line(capsys):
    message = exit_message(capsys, train_gpt2.main, "--n_lay", "6")
    assert message.endswith("error: unrecognized arguments: --n_lay 6 (see --help)"), message


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_elsewhere(monkeypatch, capsys):
    import io

    from gpt2repro.common import progress
    from tqdm import tqdm

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert isinstance(progress.progress_meter("job", "ex", total=10), tqdm)
    monkeypatch.undo()
    monkeypatch.setattr(progress, "PROGRESS_EVERY", 0)
    meter = progress.progress_meter("job", "ex", total=10)
    meter.update(4)
    meter.set_postfix(loss="1.5")
    meter.update(6)
    meter.close()
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"job: 4/10 ex \(40%\), [\d.,]+ ex/s, \d\d:\d\d left", lines[0]), lines
    assert re.fullmatch(r"job: 10/10 ex \(100%\), [\d.,]+ ex/s, loss=1.5", lines[1]), lines
    assert len(lines) == 3 and lines[2] == lines[1].replace(lines[1].split(", ")[1], lines[2].split(", ")[1])


TOO_OLD = "error: this code needs torch>=2.9 (found {}): pip install -U torch"
# The scripts that use torch; each must stop on an old torch before it reads a flag.
TORCH_SCRIPTS = ["train_gpt2.py", "bench.py", "checkpoint.py", "export_hf.py", "hellaswag.py", "sample.py",
                 "gpt2repro/training/memory.py"]
# Run as `python -c` with the script's arguments: torch as found, then its version made older.
OLD_TORCH = """
import runpy, sys
import torch
torch.__version__ = "2.8.0+cu128"
sys.path.insert(0, {repo!r})
runpy.run_path(sys.argv[1], run_name="__main__")
"""


@pytest.mark.parametrize("version", ["2.8.0", "2.8.0+cu128", "2.7.1", "2.4.1", "1.13.1", "2.0.0a0+git1234"])
def test_a_torch_older_than_the_minimum_is_named_in_one_line(version):
    assert cli.torch_problem(version) == TOO_OLD.format(version)


@pytest.mark.parametrize("version", ["2.9.0", "2.9.0a0+git1234", "2.11.0+cu130", "2.13.0+cpu", "3.0.0", "unknown"])
def test_the_minimum_and_later_pass(version):
    assert cli.torch_problem(version) is None


def test_this_torch_passes_and_requirements_txt_asks_for_the_minimum():
    assert cli.torch_problem(torch.__version__) is None
    with open(os.path.join(REPO, "requirements.txt")) as f:
        minimum = re.search(r"^torch>=(\d+)\.(\d+)\s", f.read(), re.M)
    assert tuple(map(int, minimum.groups())) == cli.MIN_TORCH


@pytest.mark.slow
def test_every_script_stops_on_an_old_torch_with_one_line_and_exit_code_1():
    """In one process per script, torch.__version__ set to 2.8 before the script runs: exit code 1,
    the one line on stderr and nothing else (no traceback), before any argument is read: not
    even --help's text reaches stdout."""
    for script in TORCH_SCRIPTS:
        result = subprocess.run([sys.executable, "-c", OLD_TORCH.format(repo=REPO), os.path.join(REPO, script), "--help"],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        assert (script, result.returncode, result.stdout, result.stderr) == \
            (script, 1, "", TOO_OLD.format("2.8.0+cu128") + "\n")


# On PYTHONPATH as sitecustomize, which Python runs before the script: the script's first import of
# a module from neither the standard library nor this repository's package (torch, numpy, matplotlib)
# says so and then waits, as a slow import would, until the signal the test sends interrupts it.
SLOW_FIRST_IMPORT = """
import importlib.abc, sys, time

class SlowFirstImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in (*sys.stdlib_module_names, "gpt2repro", "usercustomize"):
            return None
        sys.meta_path.remove(self)
        print(f"importing {name}", flush=True)
        while True:
            time.sleep(0.01)

sys.meta_path.insert(0, SlowFirstImport())
"""


@pytest.mark.parametrize("script", ["train_gpt2.py", "sample.py", "hellaswag.py", "core_eval.py", "export_hf.py",
                                    "fineweb.py", "bench.py", "checkpoint.py", "plot_log.py"])
def test_a_ctrl_c_while_a_script_imports_is_one_line_and_exit_code_130(tmp_path, script):
    (tmp_path / "sitecustomize.py").write_text(SLOW_FIRST_IMPORT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    # SIGINT as a terminal leaves it: a pytest started in the background by a script has it ignored.
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, script)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        importing = proc.stdout.readline()
        assert importing.startswith("importing "), importing + proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (cli.INTERRUPTED, "", f"{script}: interrupted\n")


def test_a_ctrl_c_ignored_from_the_start_stays_ignored():
    """As Python leaves it: a job that a script started in the background (`python train_gpt2.py &`)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        cli.exit_on_ctrl_c()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
