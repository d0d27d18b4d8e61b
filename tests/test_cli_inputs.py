"""What `plab` does with a bad flag, a bad environment variable, or an API it cannot reach or that refuses: one
line saying what was wrong and how to fix it, exit status 2, no traceback, nothing started."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from plab.cli import build_parser, main
from tests.conftest import REPO


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, message", [
    (["worker", "--slots", "0"], "argument --slots: expected a whole number >= 1, got '0'"),
    (["worker", "--slots", "-1"], "argument --slots: expected a whole number >= 1, got '-1'"),
    (["serve", "--port", "99999"], "argument --port: must be a port number from 1 to 65535, got '99999'"),
    (["serve", "--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    (["flower", "--port", "0"], "argument --port: must be a port number from 1 to 65535, got '0'"),
    (["demo", "--steps", "0"], "argument --steps: expected a whole number >= 1, got '0'"),
    (["demo", "--slots", "two"], "argument --slots: expected a whole number >= 1, got 'two'"),
    (["demo", "--port", "70000"], "argument --port: must be a port number from 1 to 65535, got '70000'"),
    (["train", "x.yaml", "--print-every", "0"], "argument --print-every: expected a whole number >= 1, got '0'"),
    (["eval", "3", "--tasks", "plab_blimp", "--limit", "0"], "argument --limit: limit must be a whole number of "
                                                              "documents per task (1 to 1,000,000) or a fraction of "
                                                              "each task's documents between 0 and 1 such as 0.1 "
                                                              "(lm-eval's --limit), got '0'"),
    (["eval", "3", "--tasks", "plab_blimp", "--limit", "1.5"], "argument --limit: limit must be a whole number of "
                                                                "documents per task (1 to 1,000,000) or a fraction"),
    (["eval", "3", "--tasks", "plab_blimp", "--limit", "nan"], "argument --limit: limit must be a whole number of "
                                                                "documents per task (1 to 1,000,000) or a fraction"),
    # a checkpoint folder instead of a run id: the local evaluation's parser states the same rule, before any model
    # is loaded
    (["eval", "/tmp", "--limit", "1.5"], "argument --limit: limit must be a whole number of documents per task "
                                         "(1 to 1,000,000) or a fraction of each task's documents between 0 and 1 "
                                         "such as 0.1 (lm-eval's --limit), got '1.5'"),
    (["eval", "/tmp", "--limit", "2000000"], "(1 to 1,000,000) or a fraction"),
    (["eval", "/tmp", "--limit", "inf"], "(1 to 1,000,000) or a fraction"),
    (["eval", "/tmp", "--rolling-context", "1"], "argument --rolling-context: --rolling-context wants a whole number "
                                                 "of tokens >= 2 (e.g. the run's data.seq_len), got '1'"),
])
def test_a_bad_flag_is_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["worker", "--gpus", "0", "--slots", "2"], "--slots 2 is for CPU jobs; with --gpus each listed GPU is one slot"),
    (["worker", "--gpus", "0,1"], "--gpus: GPU 0, 1 is not on this machine (no CUDA GPU visible); list existing "
                                  "ones, or leave --gpus out for CPU slots"),
    (["demo", "--recipes", "bf16,fp9"], "--recipes: unknown recipe 'fp9'; choose one of bf16, fp8_delayed"),
    (["demo", "--recipes", ","], "--recipes names no recipe; give e.g. --recipes bf16,fp8_tensorwise"),
    (["eval", "3", "--tasks", ","], "--tasks names no task"),
])
def test_a_bad_combination_is_refused_before_anything_starts(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"plab: error: {message}")
    assert time.monotonic() - started < 10
    assert not (tmp_path / "plab-data").exists()  # the demo made no home, started no server


def test_train_refuses_an_output_it_cannot_write_before_training(tmp_path, capsys, monkeypatch):
    from training import launch

    spec = tmp_path / "run.yaml"
    spec.write_text("model: tiny\ndata: {corpus: tinyshakespeare, vocab_size: 512, seq_len: 64}\n"
                    "training: {steps: 3, batch_size: 2, warmup_steps: 1}\n")
    (tmp_path / "blocker").write_text("a file where a folder would go")
    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("the run started"))
    assert main(["train", str(spec), "--output", str(tmp_path / "blocker" / "out")]) == 2
    assert capsys.readouterr().err == (f"plab: error: --output {tmp_path}/blocker/out: cannot create the folder "
                                       f"{tmp_path}/blocker/out (Not a directory)\n")


def test_train_says_what_the_run_found_wrong_with_its_data_in_one_line(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join('{"content": "%s"}\n' % ("word " * 40) for _ in range(50)))
    spec = tmp_path / "run.yaml"
    spec.write_text(f"model: tiny\ndata: {{corpus: {corpus}, vocab_size: 512, seq_len: 64}}\n"
                    "training: {steps: 3, batch_size: 2, warmup_steps: 1}\n")
    assert main(["train", str(spec), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"plab: error: {spec}: {corpus}:1: the line has no "
                                              "field 'text' (fields: ['content']); set data.text_field")


def test_train_refuses_a_new_run_validating_on_a_training_file_but_resumes_a_stored_one(tmp_path, capsys,
                                                                                        monkeypatch):
    from training import launch
    from training.checkpoint_files import STATE_FILE, checkpoints_root

    spec = tmp_path / "run.yaml"
    spec.write_text("model: tiny\ndata: {corpus: tinyshakespeare, val_corpus: tinyshakespeare/input.txt}\n")
    started = []
    monkeypatch.setattr(launch, "run", lambda *a, **k: started.append(k) or pytest.fail("the run started"))
    assert main(["train", str(spec), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"plab: error: {spec}: data.val_corpus shares 1 of its 1 file(s) with data.corpus: ")
    assert err.count("\n") == 1 and not started
    saved = checkpoints_root(tmp_path / "out") / "step_00000004"  # a run that began before the check
    saved.mkdir(parents=True)
    (saved / STATE_FILE).write_bytes(b"")

    class Stop(Exception):
        pass

    def record(*a, **k):
        started.append(k)
        raise Stop
    monkeypatch.setattr(launch, "run", record)
    with pytest.raises(Stop):
        main(["train", str(spec), "--output", str(tmp_path / "out")])
    assert started and started[0]["resume"] is True


def test_a_bad_port_in_the_environment_is_named_when_serving_and_harmless_otherwise(monkeypatch, capsys):
    monkeypatch.setenv("PLAB_PORT", "eighty")
    assert build_parser().parse_args(["serve"]).port is None  # building the parser reads no environment
    assert main(["serve"]) == 2
    assert capsys.readouterr().err == ("plab: error: PLAB_PORT must be a port number from 1 to 65535, got 'eighty': "
                                       "unset it or give --port\n")


def test_a_port_in_use_is_named_before_the_server_starts(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"plab: error: port {port} on 127.0.0.1 cannot be used (") and err.count("\n") == 1
    assert "choose another port with --port or PLAB_PORT" in err


@pytest.mark.parametrize("argv", [["submit", "{file}"], ["eval", "3", "--tasks", "plab_blimp"]])
def test_an_api_that_is_down_is_named_with_how_to_start_it(argv, tmp_path, capsys):
    body = tmp_path / "e.yaml"
    body.write_text("name: x\nrecipes: [bf16]\n")
    url = f"http://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    assert main([a.format(file=body) for a in argv] + ["--api-url", url]) == 2
    assert capsys.readouterr().err.startswith(f"plab: error: cannot reach the API at {url} (")
    assert time.monotonic() - started < 10  # two quick retries, not the workers' patient ones


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`plab serve` as a user starts it: the embedded default (SQLite, filesystem broker) in its own home."""
    home = tmp_path_factory.mktemp("served")
    port = closed_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PLAB_DATABASE_URL", "PLAB_BROKER_URL", "PLAB_API_TOKEN")}
    env["PLAB_HOME"] = str(home)
    proc = subprocess.Popen([sys.executable, "-m", "plab.cli", "serve", "--port", str(port), "--log-level", "warning"],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
        time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_submit_prints_the_experiment_or_the_servers_reason(served, tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("name: cli\nmodel: tiny\ndata: {corpus: tinyshakespeare, vocab_size: 512, seq_len: 64}\n"
                    "training: {steps: 30, batch_size: 2}\nrecipes: [bf16, {name: nvfp4, bf16_last_layers: 1}]\n")
    assert main(["submit", str(good), "--api-url", served]) == 0
    out = capsys.readouterr().out
    assert "'cli': 2 run(s) queued (bf16, nvfp4 bf16_last=1)" in out and f"{served}/experiments/" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: cli\nrecipes: [bf16, {name: nvfp4, options: {bf16_last_layers: 1}}]\n")
    assert main(["submit", str(bad), "--api-url", served]) == 2
    assert capsys.readouterr().err == (
        "plab: error: the server refused the experiment: recipes.1: unknown option(s) bf16_last_layers for recipe "
        "'nvfp4'; valid options: fused_quantize, fused_swiglu, rht, rht_seed, share_mlp_input, stochastic_rounding, "
        "weight_2d (bf16_last_layers: not a recipe option but a key of its own, beside the recipe's name in an "
        "experiment's recipe entry, beside `recipe` in a run spec)\n")
    assert main(["eval", "9999", "--tasks", "plab_blimp", "--api-url", served]) == 2
    assert capsys.readouterr().err == ("plab: error: the server refused an evaluation of run 9999: run 9999 does not "
                                       "exist\n")


def _train_interrupted(tmp_path, training: str, after_step: int) -> str:
    """`plab train` on a tiny spec given a real SIGINT once it printed `after_step`: its stderr, after checking the
    shell's status for SIGINT and that no traceback was printed."""
    import signal

    spec = tmp_path / "run.yaml"
    spec.write_text("model: tiny\ndata: {corpus: tinyshakespeare, vocab_size: 512, seq_len: 64}\n"
                    f"training: {{steps: 100000, batch_size: 2, warmup_steps: 1{training}}}\n")
    env = dict(os.environ, PLAB_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "plab.cli", "train", str(spec), "--output", str(tmp_path / "out"),
                             "--print-every", "1"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith(f"step {after_step:>6}"):
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    return err


def test_ctrl_c_ends_a_command_with_status_130_and_no_traceback(tmp_path):
    """A real SIGINT to `plab train` while it trains: one line, the shell's status for SIGINT, and the same command
    resumes from the checkpoint the run wrote."""
    err = _train_interrupted(tmp_path, ", checkpoint_every: 2", after_step=4)  # a checkpoint exists by then
    last = sorted((tmp_path / "out" / "checkpoints").iterdir())[-1]
    assert err.endswith(f"plab: interrupted (the same command resumes the run from its last checkpoint, "
                        f"{tmp_path / 'out' / last.name})\n"), err[-500:]


def test_ctrl_c_before_the_first_checkpoint_says_the_steps_are_lost(tmp_path):
    """checkpoint_every 0 (the default) writes a checkpoint at the end only: an interrupted run has none, and the
    message said the same command would resume it."""
    err = _train_interrupted(tmp_path, "", after_step=2)
    assert err.endswith("plab: interrupted before the run wrote a checkpoint (training.checkpoint_every: 0, one at "
                        "the end only): the same command starts it again from its first step; set "
                        "training.checkpoint_every to keep the steps a run has trained\n"), err[-500:]


def test_a_home_that_cannot_be_made_is_named_not_a_traceback(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder would go")
    assert main(["demo", "--home", str(blocker / "home"), "--no-serve"]) == 2
    assert capsys.readouterr().err == (f"plab: error: --home {blocker}/home: cannot create the folder {blocker}/home "
                                       f"(Not a directory)\n")
    monkeypatch.setenv("PLAB_HOME", str(blocker / "home"))
    monkeypatch.delenv("PLAB_DATABASE_URL", raising=False)
    assert main(["token", "list"]) == 2
    assert capsys.readouterr().err == (f"plab: error: cannot create the folder of the SQLite database "
                                       f"{blocker}/home/plab.sqlite (Not a directory): set PLAB_HOME (or "
                                       f"PLAB_DATABASE_URL) to a place this user can write\n")


def test_a_learning_rate_written_3e_4_in_yaml_is_a_number(tmp_path):
    """YAML 1.1 reads 3e-4 as a string (a float needs a dot there), so `lr: 3e-4` was refused as "must be a
    number, got '3e-4'": the plab commands read YAML 1.2's floats. Quoted, it stays text."""
    from plab.cli.common import load_file

    spec = tmp_path / "run.yaml"
    spec.write_text("training:\n  lr: 3e-4\n  weight_decay: 1E-5\n  steps: 100\nname: '1e5'\nversion: 2.5\n")
    data = load_file(str(spec))
    assert data["training"] == {"lr": 3e-4, "weight_decay": 1e-5, "steps": 100}
    assert data["name"] == "1e5" and data["version"] == 2.5
    from training.config import RunSpec

    assert RunSpec.from_dict({"model": "tiny", "data": {"corpus": "tinyshakespeare"},
                              "training": data["training"]}).training.lr == 3e-4


def test_ctrl_c_while_the_demo_trains_ends_it_with_status_130(tmp_path):
    """The demo's server and worker are stopped, and the status is the shell's for SIGINT (it was 0, as if the
    demo had finished)."""
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PLAB_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "plab.cli", "demo", "--no-serve", "--steps", "100000", "--recipes",
                             "bf16", "--slots", "1", "--port", str(port)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("[plab] experiment"):
                break
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground group
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-2000:]
    assert err.endswith("plab: interrupted before the demo's runs finished\n"), err[-500:]
    assert "Traceback" not in err


def test_no_resume_sets_an_earlier_runs_checkpoints_aside_instead_of_mixing_with_them(tmp_path, capsys):
    """A new run with --no-resume in a folder holding another run's later checkpoints: the newest two by step
    were kept, so the new run's own step 2 and 4 were pruned and the summary named a checkpoint that no longer
    existed (a review). The earlier ones are moved aside; the new run's stay and resuming it works."""
    import json

    from plab.cli import main

    def spec(name, steps, lr):
        path = tmp_path / name
        path.write_text("model: tiny\ndata: {corpus: tinyshakespeare, vocab_size: 512, seq_len: 32}\n"
                        f"training: {{steps: {steps}, batch_size: 2, warmup_steps: 1, checkpoint_every: 2, "
                        f"lr: {lr}, val_batches: 1}}\n")
        return str(path)

    out = tmp_path / "out"
    assert main(["train", spec("long.yaml", 8, "3e-3"), "--output", str(out)]) == 0
    assert main(["train", spec("short.yaml", 4, "1e-3"), "--output", str(out)]) == 2
    assert "use another output_dir, or resume=False to start a new run there" in capsys.readouterr().err
    assert main(["train", spec("short.yaml", 4, "1e-3"), "--output", str(out), "--no-resume"]) == 0
    printed = capsys.readouterr().out
    aside = [p for p in out.iterdir() if p.name.startswith("checkpoints.before-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step_00000006", "step_00000008"]
    assert f"the earlier checkpoints in this output folder were moved to {aside[0]}" in printed
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    assert json.loads(printed[printed.index("{"):])["checkpoint"].endswith("step_00000004")
    assert main(["train", spec("short.yaml", 4, "1e-3"), "--output", str(out)]) == 0  # its own: resumed (done)
    assert f"resumed from {out / 'checkpoints' / 'step_00000004'} (step 4)" in capsys.readouterr().out


def test_eval_wait_says_what_may_be_wrong_when_nothing_takes_the_evaluation(served, monkeypatch, capsys):
    """`plab eval RUN --wait` with no worker, or a message the broker lost: it waited in silence for ever (a
    review). After QUEUED_HINT_S it says what may be wrong, once, and keeps waiting until Ctrl-C."""
    from plab.cli import evaluate as cli_eval

    http = httpx.Client(base_url=served)
    exp = http.post("/api/v1/experiments", json={"name": "wait", "model": "tiny", "recipes": ["bf16"], "enqueue": False,
                                                 "data": {"corpus": "tinyshakespeare", "vocab_size": 512,
                                                          "seq_len": 64}}).json()
    rid = exp["runs"][0]["id"]
    for status in ("running", "succeeded"):
        assert http.post(f"/api/v1/runs/{rid}/status", json={"status": status}).status_code == 200
    assert http.post(f"/api/v1/runs/{rid}/artifacts", json={"kind": "checkpoint", "path": "/ckpt/final",
                                                             "step": 1}).status_code == 201
    sleeps = []

    def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt
    monkeypatch.setattr(cli_eval, "QUEUED_HINT_S", 0.0)
    monkeypatch.setattr(cli_eval.time, "sleep", sleep)
    assert main(["eval", str(rid), "--tasks", "plab_piqa", "--wait", "--api-url", served]) == 130
    out = capsys.readouterr().out
    assert out.count("is still queued after 0 minutes: no worker has taken it. Is a worker running (plab worker), "
                     "and does one take the 'default' queue?") == 1
    # --limit as lm-eval's: a fraction of each task's documents reaches the API (and the worker's job) as given
    assert main(["eval", str(rid), "--tasks", "plab_piqa", "--limit", "0.1", "--api-url", served]) == 0
    assert main(["eval", str(rid), "--tasks", "plab_piqa", "--limit", "20", "--api-url", served]) == 0
    assert [e["limit"] for e in http.get(f"/api/v1/runs/{rid}/evaluations").json()[-2:]] in ([0.1, 20], [20, 0.1])
