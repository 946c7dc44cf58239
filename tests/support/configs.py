"""The shipped configs/ loaded as a test changes them: any config file, and configs/tiny.py at the
tests' small sizes for an in-process `train()`."""

import importlib.util
import os

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def load(name, arg=None):
    """configs/NAME.py's get_config(arg), or get_config() without `arg`."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(CONFIGS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def tiny_config(*args):
    """configs/tiny.py with `--config.SECTION.KEY=VALUE` overrides, for an in-process `train()`."""
    c = load("tiny")
    for arg in args:
        key, value = arg[len("--config.") :].split("=")
        section, name = key.split(".")
        c[section][name] = type(c[section][name])(value == "True" if value in ("True", "False") else value)
    c.logging.console = False
    return c


def small_train_config(steps=3):
    """configs/tiny.py at the small model for `steps` steps, evaluations and periodic checkpoints off, no
    console, for an in-process `train()`."""
    c = load("tiny")
    c.model.hidden_size, c.model.num_hidden_layers, c.model.num_experts = 64, 2, 4
    c.model.moe_intermediate_size = 64
    c.train.steps, c.train.batch_size, c.train.seq_len = steps, 8, 32
    c.optim.warmup_steps = 1
    c.eval.every_steps, c.eval.batches, c.eval.batch_size = 0, 1, 8
    c.checkpoint.every_steps = 0
    c.logging.tensorboard, c.logging.console, c.logging.every_steps = False, False, 1
    return c
