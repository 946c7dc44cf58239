"""Loss-spike detection (zaya_jax/training/fault.py): robust statistics, the relative-jump floor, confirmation
by the next batch; on the recorded loss sequence of the default demo run and end to end on a
small-batch run over another text (no spike event), with an injected spike still rolled back."""

import gzip
import json
import os
import signal
import time

import jax
import numpy as np
import pytest
from support.train_runs import ROOT, run_train, summary_of, train_losses

from zaya_jax.config import base_config
from zaya_jax.training.events import read_events
from zaya_jax.training.fault import Do, FaultMonitor, SpikeDetector, agree, confirmed_spikes
from zaya_jax.training.metrics import read_metrics

HERE = os.path.dirname(os.path.abspath(__file__))


def _full(detector, losses):
    for x in losses:
        detector.record(x)
    return detector


def test_judge_robust_z_and_relative_floor():
    window = [3.0, 2.9, 3.1, 3.0, 2.95, 3.05]
    d = _full(SpikeDetector(zscore=4.0, window=6, min_jump=0.2), window)
    assert d.judge(3.5) is None  # z > 4 over a tight window, but only +17%: noise, not a spike
    spike = d.judge(6.0)
    assert spike is not None and spike["zscore"] > 4 and spike["median"] == pytest.approx(3.0)
    assert spike["jump"] == pytest.approx(1.0)
    # one earlier outlier in the window neither inflates the spread (mean/std would) nor hides a spike
    d = _full(SpikeDetector(zscore=4.0, window=6, min_jump=0.2), [3.0, 2.9, 9.0, 3.0, 2.95, 3.05])
    assert d.judge(6.0) is not None
    # judging records nothing; a spike needs a full window; zscore 0 is off
    assert len(d.history) == 6
    assert SpikeDetector(zscore=4.0, window=6).judge(1e9) is None
    assert _full(SpikeDetector(zscore=0.0, window=2), [1.0, 1.0]).judge(1e9) is None
    # a flat window: the spread floor (1% of the median) keeps a 0.5% wiggle ordinary
    d = _full(SpikeDetector(zscore=4.0, window=4, min_jump=0.0), [2.0] * 4)
    assert d.judge(2.01) is None and d.judge(2.5) is not None


def test_check_acts_only_on_a_confirmed_spike():
    d = _full(SpikeDetector(zscore=4.0, window=6), [3.0, 2.9, 3.1, 3.0, 2.95, 3.05])
    asked = []
    ordinary_next = lambda: asked.append(1) or 3.0
    assert d.check(3.02, ordinary_next) is None and not asked  # not anomalous: no look-ahead
    assert d.check(6.0, ordinary_next) is None and asked  # a hard batch: the next one is fine
    assert d.history[-1] == 6.0  # an unconfirmed candidate is an ordinary loss
    d = _full(SpikeDetector(zscore=4.0, window=6), [3.0, 2.9, 3.1, 3.0, 2.95, 3.05])
    spike = d.check(6.0, lambda: 5.5)
    assert spike is not None and spike["next_loss"] == 5.5 and spike["next_zscore"] > 4
    assert d.history[-1] == 3.05  # a spike does not join the window
    assert d.check(6.0) is not None  # without a look-ahead an anomalous loss is a spike


def test_default_demo_run_has_no_confirmed_spike():
    """Finding 4 on the recorded loss of every step of the full default run (configs/tiny.py, 300
    steps): a z-score over mean/std fires at step 162 (an ordinary batch; step 163 is back at the
    window's level), the default detector acts on nothing."""
    with open(os.path.join(HERE, "data", "tiny_default_losses.json")) as f:
        losses = json.load(f)["losses"]
    assert len(losses) == 300
    fault = base_config().fault
    window, zscore = fault.spike_window, fault.spike_zscore
    mean_std = [
        i + 1
        for i in range(window, len(losses))
        if (losses[i] - np.mean(losses[i - window : i])) / np.std(losses[i - window : i]) > zscore
    ]
    assert 162 in mean_std  # the false alarm of the issue
    unconfirmed = confirmed_spikes(losses, SpikeDetector(zscore, window, fault.spike_min_jump), confirm=False)
    assert [i + 1 for i in unconfirmed] == [162]  # robust and jump-floored, it is still a candidate
    assert confirmed_spikes(losses, SpikeDetector(zscore, window, fault.spike_min_jump)) == []
    # the same loss sequence with a real spike (a damaged model: the next losses stay high) is caught
    hit = list(losses)
    hit[200:202] = [4.0, 3.6]
    assert confirmed_spikes(hit, SpikeDetector(zscore, window, fault.spike_min_jump)) == [200]


@pytest.mark.slow
def test_small_batch_run_on_other_text_no_false_spike_injected_one_rolls_back(tmp_path):
    """End to end with the default detector (window 50, z 6, +20%, confirmed): 100 steps of batch 4
    on the State of the Union addresses give no spike event but the injected one: two poisoned
    batches at steps 90-91 are a confirmed spike that rolls back to the step-80 checkpoint."""
    with gzip.open(os.path.join(ROOT, "zaya_jax/data/corpus/us_state_of_the_union_1790_1864.txt.gz")) as f:
        text = tmp_path / "sotu.txt"
        text.write_bytes(f.read())
    from zaya_jax.data.prepare import main as prepare

    data = tmp_path / "data"
    assert prepare(["--input", str(text), "--out", str(data), "--doc-separator", "blank-line"]) == 0
    w = tmp_path / "w"
    run_train(
        w,
        f"--config.data.path={data}",
        "--config.train.steps=100",
        "--config.train.batch_size=4",
        "--config.optim.warmup_steps=10",
        "--config.eval.every_steps=0",
        "--config.checkpoint.every_steps=10",
        "--config.fault.inject_spike_at_steps=(90, 91)",  # a bad stretch of data: two batches
    )
    # step 90 is confirmed by the updated model's loss on the (poisoned) batch of step 91; after
    # the rollback the replayed step 91 gets one more poisoned batch, unconfirmed, and trains on it
    (spike,) = read_events(str(w), "spike")
    (rb,) = read_events(str(w), "rollback")
    assert spike["step"] == rb["step"] == 90 and rb["details"]["to_step"] == 80
    assert rb["details"]["skipped_batches"] == list(range(81, 91))
    assert spike["details"]["next_loss"] > spike["details"]["median"] * 1.2
    losses = train_losses(w)
    assert sorted(losses) == list(range(1, 101)) and all(np.isfinite(list(losses.values())))


@pytest.mark.slow
def test_rollback_decided_a_step_late_equals_the_synchronous_loop(tmp_path):
    """The loop reads step n's loss after dispatching step n + 1: a NaN at step 5 is skipped and a
    confirmed spike at step 9 (read after step 10 ran, confirmed by step 10's loss) restores the
    same checkpoint, skips the same batches and trains to the same parameters as the loop that
    reads every loss before the next dispatch (train.sync_every_step) and confirms with an eval step.
    Every step is logged, a step late too: its record (metrics, skipped count, data position) is the
    synchronous loop's."""
    from support.checkpoints import final_params

    args = [
        "--config.train.steps=12",
        "--config.checkpoint.every_steps=4",
        "--config.eval.every_steps=0",
        "--config.logging.every_steps=1",  # every step but 4, 8 and 12 is judged a step late
        "--config.fault.inject_nan_at_steps=(5,)",
        "--config.fault.inject_spike_at_steps=(9, 10)",
        "--config.fault.spike_window=4",
        "--config.fault.spike_zscore=3.0",
    ]
    runs = {}
    for mode in ("late", "sync"):
        w = tmp_path / mode
        summary = summary_of(run_train(w, *args, f"--config.train.sync_every_step={mode == 'sync'}"))
        events = {kind: read_events(str(w), kind) for kind in ("skipped_update", "spike", "rollback", "save")}
        runs[mode] = (summary, events, _train_records(w), final_params(w))
    (s_late, ev_late, loss_late, (step_late, p_late)), (s_sync, ev_sync, loss_sync, (step_sync, p_sync)) = (
        runs["late"],
        runs["sync"],
    )
    (rb,) = ev_late["rollback"]
    assert rb["step"] == 9 and rb["details"]["to_step"] == 8 and rb["details"]["skipped_batches"] == [9]
    assert [e["step"] for e in ev_late["skipped_update"]] == [5]
    for kind in ("skipped_update", "rollback", "save"):
        assert [
            (e["step"], e["details"].get("to_step"), e["details"].get("skipped_batches"))
            for e in ev_late[kind]
        ] == [
            (e["step"], e["details"].get("to_step"), e["details"].get("skipped_batches"))
            for e in ev_sync[kind]
        ], kind
    assert [e["step"] for e in ev_late["spike"]] == [e["step"] for e in ev_sync["spike"]] == [9]
    late, sync = ev_late["spike"][0]["details"], ev_sync["spike"][0]["details"]
    assert late["loss"] == sync["loss"] and late["window"] == sync["window"]
    # the confirmation: step 10's train loss (late) vs an eval step on batch 10 (sync), fp32
    assert late["next_loss"] == pytest.approx(sync["next_loss"], rel=1e-5)
    assert {k: s_late[k] for k in ("final_step", "rollbacks", "skipped_updates", "loss", "eval_loss")} == {
        k: s_sync[k] for k in ("final_step", "rollbacks", "skipped_updates", "loss", "eval_loss")
    }
    # one record per step (step 9's rolled-back record replaced by the replay's); all but the
    # wall-clock fields equal, the skipped update counted from step 5 on
    assert sorted(loss_late) == list(range(1, 13)) and loss_late == loss_sync
    assert [loss_late[s]["skipped_steps"] for s in range(1, 13)] == [0] * 4 + [1] * 8
    assert [loss_late[s]["tokens_seen"] for s in range(1, 13)] == [
        loss_sync[s]["tokens_seen"] for s in range(1, 13)
    ]
    assert step_late == step_sync == 12
    for x, y in zip(jax.tree.leaves(p_late), jax.tree.leaves(p_sync), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _train_records(workdir) -> dict[int, dict]:
    """metrics.jsonl's train records by step, without the fields that time the run."""
    timed = ("tokens_per_second", "mfu", "time")
    return {
        r["step"]: {k: v for k, v in r.items() if k not in timed}
        for r in read_metrics(str(workdir), split="train")
    }


def _fault_config(**overrides):
    f = base_config().fault
    f.update(overrides)
    return f


def _monitor(events, **overrides):
    record = lambda step, kind, **details: events.append((step, kind, details))
    return FaultMonitor(_fault_config(**overrides), record, vocab_size=16)


def test_after_step_rolls_back_on_consecutive_skipped_updates():
    events = []
    m = _monitor(events, max_bad_steps=2, spike_zscore=0.0)
    try:
        assert m.after_step(1, 3.0, False).do is Do.CONTINUE
        assert m.after_step(2, float("nan"), True).do is Do.CONTINUE  # one skipped update
        assert m.after_step(3, 3.0, False).do is Do.CONTINUE  # an accepted one resets the count
        assert m.after_step(4, float("nan"), True).do is Do.CONTINUE
        action = m.after_step(5, float("nan"), True)
        assert (action.do, action.step) == (Do.ROLL_BACK, 5) and "2 consecutive" in action.reason
        m.rolled_back()  # the count starts again after a rollback
        assert m.after_step(4, float("nan"), True).do is Do.CONTINUE
        assert m.skipped_updates == 4
        assert [(s, k) for s, k, _ in events] == [
            (2, "skipped_update"),
            (4, "skipped_update"),
            (5, "skipped_update"),
            (4, "skipped_update"),
        ]
    finally:
        m.close()


def test_after_step_rolls_back_only_on_a_confirmed_spike():
    """The delayed verdict: after_step(step n) asks the next loss only for an anomalous loss; with
    spike_confirm a hard batch followed by an ordinary loss continues, a damaged model rolls back;
    without it the anomalous loss alone rolls back."""
    window = [3.0, 2.9, 3.1, 3.0, 2.95, 3.05]
    for confirm, next_loss, expected in [
        (True, 3.0, Do.CONTINUE),
        (True, 5.5, Do.ROLL_BACK),
        (False, 3.0, Do.ROLL_BACK),
    ]:
        events, asked = [], []
        m = _monitor(events, spike_window=6, spike_zscore=4.0, spike_confirm=confirm)
        try:
            for step, loss in enumerate(window, start=1):
                assert m.after_step(step, loss, False, lambda: asked.append(0) or 99.0).do is Do.CONTINUE
            assert not asked  # ordinary losses never ask for the look-ahead
            action = m.after_step(7, 6.0, False, lambda: next_loss)
            assert action.do is expected and action.step == 7
            assert [k for _, k, _ in events] == (["spike"] if expected is Do.ROLL_BACK else [])
        finally:
            m.close()


def test_poison_hooks_fire_until_their_step_is_judged():
    events = []
    m = _monitor(events, inject_nan_at_steps=(2,), inject_spike_at_steps=(3,))
    batch = {
        "input_ids": np.zeros((2, 4), np.int32),
        "targets": np.ones((2, 4), np.int32),
        "loss_mask": np.ones((2, 4), np.float32),
    }
    try:
        assert m.poison(1, batch) is batch
        assert np.isnan(m.poison(2, batch)["loss_mask"]).all()
        spiked = m.poison(3, batch)
        assert (spiked["targets"] == 15).all() and (batch["targets"] == 1).all()  # a copy, last id
        m.after_step(2, 3.0, False)  # judged: a replay of step 2 (after a rollback) is clean
        assert m.poison(2, batch) is batch and m.poison(3, batch) is not batch
    finally:
        m.close()


def test_boundary_agrees_on_a_stop_signal_and_close_restores_handlers():
    assert agree([True, False], 0) == [True, False]  # one process: its own flags
    before = signal.getsignal(signal.SIGTERM)
    m = _monitor([])
    try:
        b = m.boundary(1, save_due=True)
        assert (b.stop, b.save) == (False, True)
        os.kill(os.getpid(), signal.SIGTERM)  # handled: a flag, the process keeps running
        b = m.boundary(2, save_due=False)
        assert (b.stop, b.save) == (True, False) and m.stop.signum == signal.SIGTERM
    finally:
        m.close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_watchdog_is_armed_only_for_a_known_program():
    hung = []
    m = _monitor([], step_timeout_s=0.2)
    m.watchdog._on_timeout = lambda step, elapsed: hung.append(step)  # instead of exiting
    try:
        m.watch(1, known_program=False)  # compiling: not a hang
        time.sleep(0.5)
        assert hung == []
        m.watch(2, known_program=True)
        time.sleep(0.6)
        assert hung == [2]
        m.watch(3, known_program=True)
        m.unwatch()
        time.sleep(0.5)
        assert hung == [2]
    finally:
        m.close()
