"""lm-evaluation-harness' model `zaya_jax` (zaya_jax/lm_eval/): `python -m zaya_jax.lm_eval` on an
Orbax checkpoint gives what `--model hf` gives on its export (acc, acc_norm, per-request
log-likelihoods within 1e-4, rolling perplexity, greedy generations with stop sequences), also over
2 processes; `eval.harness_tasks` logs the same numbers during training; a bad value is one line.
Offline: local task YAMLs over JSONL, one tiny random model shared by the module."""

import glob
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from support import cli_fork
from support.eval_models import orbax_from_hf, random_byte_model, write_harness_tasks
from support.events import event_tags
from support.torch_threads import one_torch_thread  # noqa: F401  (autouse: lm-eval's HF model on one thread)
from support.train_runs import ROOT, SMALL, run_train
from support.xla_env import COMPILE_FLAGS, xla_flags

from zaya_jax.data.tokenizer import ByteTokenizer
from zaya_jax.export import export
from zaya_jax.runtime import cli
from zaya_jax.training.metrics import read_metrics

MAX_LEN = 64  # several rolling windows per document; the longest prompt is cut from the left
MAX_GEN = 40  # new tokens: three chunks between stop checks (STOP_EVERY = 16)
INIT = 0.5  # weights' scale: greedy continuations vary (at 0.2 they repeat one byte)
GEN_PROMPTS = [
    "The cat sat on the",
    "Once upon a time",
    "Call me Ishmael. Some years ago - never mind how long",
    "Ünïcödé",
]
TASKS = ["zaya_mc", "zaya_ppl", "zaya_gen"]


def free_continuation(ckpt: str, prompt: str) -> list[int]:
    """Our greedy continuation of `prompt` without stop sequences (lm-eval's prefix none)."""
    from zaya_jax.generate import generate
    from zaya_jax.hf.pretrained import load_model

    m = load_model(ckpt, prefix="none")
    return generate(m.cfg, m.variables, [m.tokenizer.encode(prompt)], MAX_GEN)[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random byte-vocabulary model: HF -> import_hf (the Orbax checkpoint we read) -> export (fp32,
    what `--model hf` reads); the tasks, with a stop string the first prompt meets after 16 tokens."""
    d = tmp_path_factory.mktemp("harness")
    random_byte_model(initializer_range=INIT).save_pretrained(str(d / "random_hf"))
    ckpt = orbax_from_hf(str(d / "random_hf"), str(d / "run"))
    export(ckpt, str(d / "hf"), dtype="float32")
    tokens = free_continuation(ckpt, GEN_PROMPTS[0])
    text = ByteTokenizer().decode(tokens)
    stop = next(c for c in text[16:] if c.isascii() and c.isprintable() and c not in text[:16])
    assert "\n\n" not in text and 1 not in tokens  # the stop string is what ends this one
    write_harness_tasks(d, GEN_PROMPTS, until=(stop, "\n\n"), max_gen=MAX_GEN)
    return {"dir": d, "ckpt": str(d / "run"), "free": text, "free_tokens": tokens, "stop": stop}


@pytest.fixture(scope="module")
def datasets_env(tmp_path_factory) -> dict[str, str]:
    """lm-eval reads the task JSONL through `datasets`: offline, cached under the test's tmp dir."""
    return {"HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("datasets_cache"))}


@pytest.fixture(autouse=True)
def offline(monkeypatch, datasets_env):
    for k, v in datasets_env.items():
        monkeypatch.setenv(k, v)


def read_output(out_dir) -> tuple[dict, dict]:
    """(results, samples per task) of one `--output_path DIR --log_samples` run."""
    [results] = glob.glob(f"{out_dir}/*/results_*.json")
    samples = {}
    for task in TASKS:
        [path] = glob.glob(f"{out_dir}/*/samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in open(path)]
        samples[task] = sorted(rows, key=lambda s: s["doc_id"])
    return json.load(open(results))["results"], samples


def cli_args(m, out_dir, mesh="none") -> list[str]:
    return [
        "--model", "zaya_jax", "--model_args", f'checkpoint={m["ckpt"]},max_length={MAX_LEN},mesh="{mesh}"',
        "--tasks", ",".join(TASKS), "--include_path", str(m["dir"] / "tasks"),
        "--output_path", str(out_dir), "--log_samples",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def ours(model_dir, datasets_env):
    """`python -m zaya_jax.lm_eval` on the Orbax checkpoint, one process, one device."""
    from zaya_jax.lm_eval.__main__ import main

    out = model_dir["dir"] / "ours"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in datasets_env.items():
            mp.setenv(k, v)
        cli.run(main, cli_args(model_dir, out))
    return read_output(out)


def simple_evaluate(m, model: str, model_args: str, tasks=TASKS) -> tuple[dict, dict]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import zaya_jax.lm_eval.backend  # noqa: F401  (registers zaya_jax)

    manager = TaskManager(include_path=str(m["dir"] / "tasks"), include_defaults=False)
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=tasks, task_manager=manager, device="cpu", log_samples=True
    )
    samples = {t: sorted(rows, key=lambda s: s["doc_id"]) for t, rows in out["samples"].items()}
    return out["results"], samples


def loglik_gap(a: dict, b: dict, task: str) -> float:
    """Worst |delta log-likelihood| over every request of `task` (each choice, each document)."""
    gap = 0.0
    for x, y in zip(a[task], b[task], strict=True):
        for rx, ry in zip(x["filtered_resps"], y["filtered_resps"], strict=True):
            pair = isinstance(rx, (list, tuple))  # (loglikelihood, is_greedy); rolling: a number
            lx, ly = (float(rx[0]), float(ry[0])) if pair else (float(rx), float(ry))
            gap = max(gap, abs(lx - ly))
            if pair:
                assert str(rx[1]) == str(ry[1])  # is_greedy
    return gap


def loglik_tolerance(x: float) -> float:
    """1e-4, or 4 float32 ulps of x where that is more: a rolling log-likelihood is a sum over a
    whole document (about -600 nats here, where one float32 ulp is 6.1e-5) that hf and we add up
    in float32 in different orders."""
    return max(1e-4, 4 * float(np.spacing(np.float32(abs(x)))))


def assert_logliks_agree(a: dict, b: dict, task: str) -> float:
    """Every request's log-likelihood of `task` agrees within `loglik_tolerance`; returns the worst
    |delta| (loglik_gap)."""
    for x, y in zip(a[task], b[task], strict=True):
        for rx, ry in zip(x["filtered_resps"], y["filtered_resps"], strict=True):
            lx, ly = (float(rx[0]), float(ry[0])) if isinstance(rx, (list, tuple)) else (float(rx), float(ry))
            assert abs(lx - ly) <= loglik_tolerance(lx), (task, lx, ly)
    return loglik_gap(a, b, task)


def generations(samples: dict) -> list[str]:
    return [s["filtered_resps"][0] for s in samples["zaya_gen"]]


def agreement(theirs, their_samples, mine, my_samples, tasks=TASKS) -> dict:
    """Asserts the agreement of two runs; returns the table (theirs, ours) per metric."""
    table = {}
    for task in tasks:
        for key, value in theirs[task].items():
            if "," in key and "_stderr" not in key:
                table[f"{task}/{key}"] = (value, mine[task][key])
                if "perplexity" in key or "bits" in key:
                    assert mine[task][key] == pytest.approx(value, rel=1e-5), key
                else:
                    assert mine[task][key] == value, key
        if task != "zaya_gen":
            table[f"{task}/worst_loglik_diff"] = assert_logliks_agree(their_samples, my_samples, task)
    if "zaya_gen" in tasks:
        table["zaya_gen/generations_equal"] = generations(their_samples) == generations(my_samples)
        assert generations(their_samples) == generations(my_samples)
    return table


@pytest.mark.slow
def test_zaya_jax_on_a_checkpoint_equals_hf_on_its_export(model_dir, ours):
    args = f"pretrained={model_dir['dir'] / 'hf'},dtype=float32,max_length={MAX_LEN},batch_size=2"
    theirs, their_samples = simple_evaluate(model_dir, "hf", args)
    table = agreement(theirs, their_samples, *ours)
    print("lm-eval --model hf (export) vs --model zaya_jax (checkpoint):", json.dumps(table, indent=1))
    # the stop string ended the first prompt's generation after 16 tokens (in a second decoding chunk)
    gen = generations(ours[1])[0]
    assert gen == model_dir["free"][: model_dir["free"].index(model_dir["stop"])] and len(gen) >= 16

    # prefix=bos <-> add_bos_token=True (multiple choice; from Python, as lm-eval's own API is used)
    bos = f"checkpoint={model_dir['ckpt']},max_length={MAX_LEN},mesh=none,prefix=bos"
    mine_bos = simple_evaluate(model_dir, "zaya_jax", bos, ["zaya_mc"])
    theirs_bos = simple_evaluate(model_dir, "hf", args + ",add_bos_token=True", ["zaya_mc"])
    print("add_bos_token=True vs prefix=bos:", agreement(*theirs_bos, *mine_bos, ["zaya_mc"]))
    assert loglik_gap(mine_bos[1], ours[1], "zaya_mc") > 1e-2  # the BOS changes every score


def _two_process_env():
    # no persistent compilation cache: see tests/test_train.py::_two_processes. XLA's default code
    # generation (the launcher adds the device count): numbers compared to 1e-6 round as users'.
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "ZAYA_LAUNCH_PLATFORM": "cpu",
        "JAX_ENABLE_COMPILATION_CACHE": "false",
        "XLA_FLAGS": COMPILE_FLAGS,
    }
    for k in ("ZAYA_COORDINATOR", "ZAYA_NUM_PROCESSES", "ZAYA_PROCESS_ID", "ZAYA_LOCAL_DEVICE_IDS"):
        env.pop(k, None)
    return env


@pytest.mark.slow
def test_two_processes_match_one(model_dir):
    """2 processes x 2 CPU devices on a data=2 x expert=2 mesh: every process runs every request;
    process 0 alone writes; the numbers are the one-device run's. Both sides compile as users do
    (XLA's default code generation): at LLVM O0 the two perplexities differ by more than 1e-6."""
    one, out = model_dir["dir"] / "one_device", model_dir["dir"] / "two_processes"
    env = _two_process_env()
    # the one-device run forks from the CLI server (tests/support/cli_fork.py): jax read
    # JAX_ENABLE_COMPILATION_CACHE at the server's import, so its programs may be cached (one device:
    # none that deadlocks read back)
    one_device = {**env, "XLA_FLAGS": xla_flags(1, fast=False)}
    server = cli_fork.shared(one_device)
    r = server.run("lm_eval", *cli_args(model_dir, one), env=one_device, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    launch = [os.path.join(ROOT, "launch", "local_multiprocess.sh"), "2", "2", "--"]
    cmd = ["bash", *launch, sys.executable, "-m", "zaya_jax.lm_eval"]
    cmd += cli_args(model_dir, out, "data=2,expert=2")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[p0] |zaya_mc" in r.stdout and "[p1] |zaya_mc" not in r.stdout  # one table, process 0's
    results, samples = read_output(out)  # exactly one results file (read_output unpacks one)
    mine, my_samples = read_output(one)
    for task in TASKS:
        for key, value in mine[task].items():
            if "," in key and "_stderr" not in key:
                assert results[task][key] == pytest.approx(value, rel=1e-6), (task, key)
    for task in ("zaya_mc", "zaya_ppl"):  # log-likelihoods of 10 to 1000 nats: fp32 rounding apart
        assert_logliks_agree(samples, my_samples, task)
    assert generations(samples) == generations(my_samples)


@pytest.mark.slow
def test_training_logs_the_harness_metrics_of_the_cli(model_dir, tmp_path):
    tasks = f"--config.eval.harness_tasks=({', '.join(repr(t) for t in TASKS)})"
    run_train(
        tmp_path / "w", "--config.train.steps=3", "--config.eval.every_steps=3", tasks,
        f"--config.eval.harness_include_path={model_dir['dir'] / 'tasks'}",
        f"--config.eval.task_max_len={MAX_LEN}",
        "--config.logging.tensorboard=True",
    )  # fmt: skip
    [last] = [r for r in read_metrics(str(tmp_path / "w")) if r["split"] == "eval"]
    logged = {k: v for k, v in last.items() if k.startswith("eval_harness/")}
    assert set(logged) == {
        "eval_harness/zaya_mc/acc", "eval_harness/zaya_mc/acc_norm", "eval_harness/zaya_gen/exact_match",
        *(f"eval_harness/zaya_ppl/{m}" for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")),
    }  # fmt: skip
    tags = event_tags(tmp_path / "w" / "tensorboard")
    assert all(tags[f"eval/{k[len('eval_') :]}"] == [(3, pytest.approx(v))] for k, v in logged.items())

    # the saved step, scored by the backend as `python -m zaya_jax.lm_eval` scores it
    args = f"checkpoint={tmp_path / 'w'},max_length={MAX_LEN},mesh=none"
    standalone, _ = simple_evaluate(model_dir, "zaya_jax", args)
    for key, value in logged.items():
        task, metric = key.split("/")[1:]
        assert math.isclose(value, standalone[task][f"{metric},none"], rel_tol=1e-5), key


@pytest.mark.slow
def test_training_start_up_errors(model_dir, tmp_path):
    """A task lm-eval does not know, or no lm-eval at all: one line naming the key, before step 1."""
    include = f"--config.eval.harness_include_path={model_dir['dir'] / 'tasks'}"
    r = run_train(tmp_path / "a", "--config.eval.harness_tasks=('zaya_mcq',)", include, check=False)
    assert r.returncode == 2 and not (tmp_path / "a" / "checkpoints").exists()
    assert r.stderr.strip().splitlines()[-1] == (
        "error: config.eval.harness_tasks: no lm-evaluation-harness task 'zaya_mcq' (neither built in or "
        f"under {model_dir['dir'] / 'tasks'}) (did you mean zaya_mc?)"
    )
    hide = "import sys; sys.modules['lm_eval'] = None; import runpy; "  # lm-eval not installed
    code = hide + "sys.argv[0] = 'train'; runpy.run_module('zaya_jax.train', run_name='__main__')"
    cmd = [sys.executable, "-c", code, "--config", os.path.join(ROOT, "configs/tiny.py"), "--workdir",
           str(tmp_path / "b"), *SMALL, "--config.eval.harness_tasks=('zaya_mc',)", include]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error: config.eval.harness_tasks needs lm-evaluation-harness")
        and "[interop]" in last
    )


def test_the_cli_without_lm_eval_is_one_line():
    code = (
        "import sys, runpy; sys.modules['lm_eval'] = None; sys.argv = ['lm_eval', '--tasks', 'zaya_mc']; "
        "runpy.run_module('zaya_jax.lm_eval', run_name='__main__')"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    [line] = r.stderr.strip().splitlines()
    assert r.returncode == 2 and line.endswith(": pip install -e '.[interop]'")
    assert line.startswith("error: python -m zaya_jax.lm_eval needs lm-evaluation-harness, which cannot be")


BAD = [
    ("--model_args checkpoint={ckpt},batch_size=0", "--model_args batch_size=0: must be an int >= 1"),
    ("--model_args checkpoint={ckpt},max_length=1", "--model_args max_length=1: must be an int >= 2"),
    ("--model_args checkpoint={ckpt},max_gen_toks=0", "--model_args max_gen_toks=0: must be an int >= 1"),
    ("--model_args checkpoint={ckpt},seed=-1", "--model_args seed=-1: must be an int >= 0"),
    (
        "--model_args checkpoint={ckpt},prefix=start",
        "--model_args prefix=start: must be none, bos, eos, auto",
    ),
    (
        "--model_args checkpoint={ckpt},dtype=float16",
        "--model_args dtype=float16: must be float32 or bfloat16",
    ),
    ("--model_args checkpoint={ckpt},mesh=data=3,expert=2", "--model_args expert: unknown key"),
    (
        "--model_args checkpoint={ckpt},mesh=dat=3",
        "--model_args mesh=dat=3: --mesh 'dat=3': expected axis=size",
    ),
    ("--model_args checkpoint={ckpt},batchsize=8", "--model_args batchsize: unknown key"),
    ("--model_args checkpoint={ckpt}/nothing", "--model_args checkpoint={ckpt}/nothing: does not exist"),
    ("--model_args batch_size=8", "--model_args checkpoint=PATH is required"),
    (
        "--model_args checkpoint={ckpt} --batch_size auto",
        "argument --batch_size/-b: must be a whole number (zaya_jax takes no 'auto') >= 1",
    ),
    (
        "--model_args checkpoint={ckpt},batch_size=4 --batch_size 8",
        "--batch_size 8 and --model_args batch_size=4 differ",
    ),
    (
        "--model_args checkpoint={ckpt} --limit 0",
        "argument --limit/-L: must be a whole count >= 1 or a fraction in (0, 1), got '0'",
    ),
    ("--model_args checkpoint={ckpt} --limit 2.5", "argument --limit/-L: must be a whole count >= 1"),
    ("--model_args checkpoint={ckpt} --num_fewshot -1", "argument --num_fewshot/-f: must be an int >= 0"),
    (
        "--model_args checkpoint={ckpt} --num_fewshot two",
        "argument --num_fewshot/-f: must be an int >= 0, got 'two'",
    ),
    ("--model_args checkpoint={ckpt} --max_batch_size 0", "argument --max_batch_size: must be an int >= 1"),
    ("--model_args checkpoint={ckpt} --seed -1", "argument --seed: must be one or four seeds in [0, 2**32)"),
    ("--model_args checkpoint={ckpt} --verbosity loud", "argument --verbosity/-v: must be one of DEBUG"),
    (
        "--model_args checkpoint={ckpt} --gen_kwargs top_p=2",
        "--gen_kwargs top_p=2: must be a number in (0, 1]",
    ),
    (
        "--model_args checkpoint={ckpt} --gen_kwargs temperature=-1",
        "--gen_kwargs temperature=-1.0: must be a number",
    ),
    (
        "--model_args checkpoint={ckpt} --gen_kwargs max_gen_toks=0",
        "--gen_kwargs max_gen_toks=0: must be a whole",
    ),
    ("--model_args checkpoint={ckpt} --gen_kwargs top_k=5", "--gen_kwargs top_k: not supported by zaya_jax"),
    (
        "--model_args checkpoint={ckpt} --apply_chat_template",
        "--apply_chat_template: zaya_jax models have no chat",
    ),
]


@pytest.mark.parametrize("args, message", BAD, ids=[b[1].split(":")[0] for b in BAD])
def test_a_bad_value_is_one_line_naming_it(tmp_path, capsys, args, message):
    from zaya_jax.lm_eval.__main__ import main

    ckpt = str(tmp_path)
    argv = [a.format(ckpt=ckpt) for a in args.split(" ")] + ["--tasks", "zaya_mc"]
    with pytest.raises(SystemExit) as e:
        cli.run(main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: " + message.format(ckpt=ckpt)), (
        err
    )


def test_generation_kwargs_are_checked_and_sampling_is_seeded(model_dir, ours):
    """A task's generation_kwargs: greedy by default; do_sample=True samples at the temperature,
    the same text for the same seed; an unsupported key or do_sample without a temperature fails.
    (After `ours`: the same batch and lengths reuse its compiled decoding.)"""
    from lm_eval.api.instance import Instance

    from zaya_jax.lm_eval.backend import ZayaLM

    lm = ZayaLM(checkpoint=model_dir["ckpt"], max_length=MAX_LEN, mesh="none")

    def run(**gen_kwargs):
        kwargs = {"max_gen_toks": MAX_GEN, **gen_kwargs}
        reqs = [Instance("generate_until", {}, (p, kwargs), i) for i, p in enumerate(GEN_PROMPTS)]
        return lm.generate_until(reqs)

    greedy, sampled = run(), run(do_sample=True, temperature=1.5)
    assert greedy[0] == model_dir["free"] and sampled != greedy
    assert run(do_sample=True, temperature=1.5) == sampled
    for bad, message in [({"top_k": 5}, "generation_kwargs top_k: not supported"),
                         ({"do_sample": True}, "do_sample=True needs a temperature > 0"),
                         ({"max_gen_toks": MAX_LEN}, "must be < max_length=64")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            run(**bad)
