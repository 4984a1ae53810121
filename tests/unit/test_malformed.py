"""Property test: every malformed input to `prl submit --dry-run` exits 2 with one line that names
the key (or the file, or the override), no traceback, and nothing created.

    pytest tests/unit/test_malformed.py -s     # prints how many inputs were tried

Generated kinds: a wrong container type anywhere (list for a section or mapping, mapping for a list
or a value), non-finite numbers, empty or dotted-empty keys, run names that are '.', '..', too long or
contain '/', non-POSIX environment variable names, output dirs that are files or kernel file systems,
config files that are directories, scalars, lists, or hold bad `defaults:` or wrongly shaped sections.
Listed cases (issue 53, item 7): control characters in what other users see, FIFOs as the config,
dangerous weight roots, wildcard addresses, known variables as the key, --chdir, setup lines that do
not parse, paths with control characters in an error.
"""

import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prl.control.cli import main

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs/toy.yaml")
SECTIONS = ["run", "model", "slurm", "inference", "trainer", "orchestrator", "run.wandb", "trainer.checkpoint",
            "trainer.loss", "orchestrator.sampling", "orchestrator.environment"]
MAPPINGS = ["env", "inference.env", "trainer.env", "orchestrator.env", "orchestrator.environment.args",
            "trainer.loss.custom_args"]
LISTS = ["slurm.setup", "slurm.extra_sbatch", "inference.extra_args"]
SCALARS = ["run.name", "run.max_steps", "model.name", "model.dtype", "slurm.time", "slurm.partition", "trainer.nodes",
           "trainer.loss.type", "trainer.micro_batch_tokens",
           "trainer.lr", "inference.port", "orchestrator.batch_size", "orchestrator.environment.id", "env.HF_HOME"]
FLOATS = ["trainer.lr", "trainer.weight_decay", "trainer.max_grad_norm", "trainer.loss.clip_low", "trainer.loss.clip_high",
          "trainer.loss.kl_tau", "trainer.loss.dppo_mask_low", "trainer.loss.ratio_mask_low", "trainer.loss.ratio_mask_high",
          "trainer.keep_logits_gib", "trainer.activation_checkpointing_fraction", "inference.gpu_memory_utilization", "orchestrator.sampling.temperature",
          "orchestrator.sampling.top_p"]
POSIX_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

words = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
lists = st.lists(st.one_of(st.integers(-9, 99), words), min_size=0, max_size=3).map(lambda xs: f"[{','.join(map(str, xs))}]")
mappings = st.dictionaries(words, st.one_of(st.integers(0, 9), words), min_size=1, max_size=2).map(
    lambda d: "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}")
scalars = st.one_of(st.integers(-5, 500).map(str), words)


def override(keys, values):
    """(override, the text the message must contain): the key path."""
    return st.tuples(st.sampled_from(keys), values).map(lambda kv: ("override", f"{kv[0]}={kv[1]}", kv[0]))


bad_names = st.one_of(
    st.sampled_from([".", ".."]),
    st.from_regex(r"[a-z0-9_.-]{0,5}/[a-z0-9_./-]{0,5}", fullmatch=True),
    st.text(alphabet="abcxyz019-_.", min_size=128, max_size=300).map(lambda s: "n" + s),  # "n": not a YAML number
)
bad_env_names = st.text(alphabet="AZaz09_-+:@ÄéΩ", min_size=1, max_size=8).filter(lambda n: not POSIX_NAME.fullmatch(n))
empty_keys = st.sampled_from(["=5", ".a=1", "trainer..nodes=2", "trainer.=3", "..=x", "env..X=1", "a.b..c=[1]"])
yaml_texts = st.one_of(
    st.sampled_from(["hello\n", "5\n", "- a\n- b\n", "'just a string'\n", "3.5\n", "defaults: 5\n",
                     "defaults: [1, 2]\n", "defaults: {a: b}\n", "defaults: [null]\n"]).map(lambda t: (t, None)),
    st.tuples(st.sampled_from(SECTIONS + MAPPINGS), st.one_of(lists, scalars)).map(
        lambda kv: (f"defaults: [{TOY}]\n{kv[0]}: {kv[1]}\n", kv[0].split(".")[-1])),
    st.tuples(st.sampled_from(LISTS), st.one_of(mappings, scalars)).map(
        lambda kv: (f"defaults: [{TOY}]\n{kv[0]}: {kv[1]}\n", kv[0].split(".")[-1])),
)

cases = st.one_of(
    override(SECTIONS + MAPPINGS, st.one_of(lists, scalars)),
    override(LISTS, st.one_of(mappings, scalars)),
    override(SCALARS, st.one_of(lists, mappings)),
    override(FLOATS, st.sampled_from(["inf", "-inf", "nan", ".inf", "-.inf", "1e999", "-1e999"])),
    empty_keys.map(lambda o: ("override", o, o)),
    bad_names.map(lambda n: ("override", f"run.name={n}", "run.name")),
    st.tuples(st.sampled_from(["env", "inference.env", "trainer.env", "orchestrator.env"]), bad_env_names).map(
        lambda sn: ("override", f"{sn[0]}.{sn[1]}=1", f"{sn[0]}.{sn[1]}")),
    st.sampled_from(["file", "file/sub", "/proc/prl", "/sys/prl/x", "/proc"]).map(lambda d: ("output_dir", d, "run.output_dir")),
    yaml_texts.map(lambda tk: ("yaml", tk[0], tk[1])),
    st.just(("directory", "", None)),
)


def run_case(kind: str, value: str, key: str | None, tmp: Path) -> tuple[int, str, str]:
    """Build the inputs in `tmp`, run `prl submit ... --dry-run` in-process; (exit, stderr, expected text)."""
    config, overrides, expect = TOY, [f"run.output_dir={tmp / 'out'}"], key
    if kind == "override":
        overrides.append(value)
    elif kind == "output_dir":
        (tmp / "file").write_text("x")
        overrides = [f"run.output_dir={tmp / value if not value.startswith('/') else value}"]
    elif kind == "yaml":
        config = str(tmp / "c.yaml")
        Path(config).write_text(value)
        expect = key or config
    else:  # a directory where a config file is expected
        config = expect = str(tmp)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["submit", config, "--dry-run", *overrides])
    return rc, err.getvalue(), expect


def test_malformed_inputs_exit_2_naming_the_key(capsys, record_property):
    tried = []

    @settings(max_examples=250, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case):
        tried.append(case)
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            before = sorted(tmp.rglob("*"))
            cwd = os.getcwd()
            os.chdir(tmp)
            try:
                try:
                    rc, err, expect = run_case(*case, tmp)
                except SystemExit as e:  # argparse
                    rc, err, expect = e.code, "", case[2]
            finally:
                os.chdir(cwd)
            assert rc == 2, (case, err)
            assert err.startswith("prl: error: ") and err.count("\n") == 1, (case, err)
            assert expect in err and "Traceback" not in err, (case, err)
            assert not (tmp / "out").exists() and sorted(tmp.rglob("*")) == sorted({*before, *tmp.glob("file"), *tmp.glob("c.yaml")})

    check()
    record_property("malformed_inputs_tried", len(tried))
    with capsys.disabled():
        print(f"\n{len(tried)} malformed inputs tried, each refused with exit 2 and one line naming the key")
    assert len(tried) >= 100


# --- issue 53, item 7: the small holes, each refused with exit 2 and one line naming the key ------------
HOLES = [
    # YAML refuses most control characters in an override; a file's double-quoted escapes bring them in.
    *[(f'run: {{name: "a{c}b"}}', "run.name") for c in ("\\e[2J", "\\a", "\\r", "\\t", "\\x7f", "\\N")],
    ('slurm: {job_name: "x\\e]0;owned\\a"}', "slurm.job_name"),
    ('run: {wandb: {group: "g\\e"}}', "run.wandb.group"),
    ('slurm: {extra_sbatch: ["--comment=\\e[8m"]}', "slurm.extra_sbatch[0]"),
    ("inference.weights_root=/", "inference.weights_root"),
    ("inference.weights_root=/etc/ssl", "inference.weights_root"),
    ("inference.weights_root=/tmp", "inference.weights_root"),
    ("inference.weights_root='~/'", "inference.weights_root"),
    ("inference.weights_root={tmp}", "inference.weights_root"),  # holds the run directory
    ("inference.weights_root={tmp}/out/toy", "inference.weights_root"),  # is it: RUN/secret
    *[(f"inference.host={h}", "inference.host") for h in ("0.0.0.0", "::", "0", "0.0", "0:0::0")],
    *[(f"inference.api_key_env={v}", "inference.api_key_env")
      for v in ("PATH", "HOME", "SLURM_JOB_ID", "PRL_RUN_DIR", "LD_PRELOAD", "PYTHONPATH")],
    *[(f"slurm.extra_sbatch=[{o}]", "slurm.extra_sbatch[0]") for o in ("--chdir=/tmp", "'--chdir /tmp'", "-D/tmp",
                                                                       "'-D /tmp'", "--chd=/tmp", "-vD/tmp")],
    ("trainer.slurm.extra_sbatch=[--chdir=/tmp]", "trainer.slurm.extra_sbatch[0]"),
    ("slurm.srun_args=[--chdir=/tmp]", "slurm.srun_args[0]"),
    ("slurm.setup=[fi]", "slurm.setup[0]"),
    ("slurm.setup=['module load x',\"if true; then\"]", "slurm.setup[1]"),
    ("trainer.slurm.setup=['echo \"unterminated']", "trainer.slurm.setup[0]"),
    ("inference.slurm.setup=['done; ${oc.env:HOME}']", "inference.slurm.setup[0]"),
]


def submit_in_process(tmp: Path, config: str, *overrides: str) -> tuple[int, str]:
    err = io.StringIO()
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["submit", config, "--dry-run", f"run.output_dir={tmp / 'out'}",
                       f"model.name={ROOT / '.cache/tiny-qwen2'}", *overrides])
    finally:
        os.chdir(cwd)
    return rc, err.getvalue()


@pytest.mark.parametrize("override, key", HOLES, ids=[repr(o) for o, _ in HOLES])
def test_small_holes_are_refused_naming_the_key(tmp_path, override, key):
    """Control characters in what other users see, dangerous weight roots, wildcard listen
    addresses, a key variable whose value others know, another working directory for the job,
    setup lines that do not parse: exit 2, one line that names the key, nothing written."""
    config = TOY
    if ": {" in override:  # a YAML file's section
        config = str(tmp_path / "c.yaml")
        Path(config).write_text(f"defaults: [{TOY}]\n{override}\n")
    rc, err = submit_in_process(tmp_path, config, *([override.replace("{tmp}", str(tmp_path))] if config == TOY else []))
    assert rc == 2 and err.startswith(f"prl: error: {key}: ") and err.count("\n") == 1, err
    assert "\x1b" not in err and "\r" not in err and "\x07" not in err
    assert not (tmp_path / "out").exists()


def test_their_neighbours_are_accepted(tmp_path):
    rc, err = submit_in_process(tmp_path, TOY, "inference.weights_root=/data/models", "inference.host=10.1.2.3",
                                "inference.api_key_env=MY_VLLM_KEY", "slurm.extra_sbatch=[--comment=Dx]",
                                "slurm.setup=['if true; then :; fi', '# a comment']")
    assert rc == 0, err


def test_a_fifo_as_the_config_is_refused_without_blocking(tmp_path):
    """Opening a FIFO to read waits for a writer: prl submit would hang for good."""
    os.mkfifo(tmp_path / "c.yaml")
    r = subprocess.run([sys.executable, "-m", "prl.control.cli", "submit", str(tmp_path / "c.yaml"), "--dry-run"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and r.stderr == f"prl: error: {tmp_path / 'c.yaml'}: is a FIFO, not a config file\n"


@pytest.mark.parametrize("name", ["a\nb.yaml", "a\x1b[31mred.yaml", "a\rb.yaml"])
def test_an_error_naming_a_path_with_control_characters_stays_one_line(tmp_path, name):
    (tmp_path / name).write_text("run: [1]\n")  # a malformed file: the error names it
    for path in (tmp_path / name, tmp_path / "missing" / name):
        rc, err = submit_in_process(tmp_path, str(path))
        assert rc == 2 and err.count("\n") == 1 and repr(name)[1:-1] in err, err
