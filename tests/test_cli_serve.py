"""`diffcast serve`: its flags become one ServerConfig, and every engine runs behind the same server."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app.cli import build_parser
from app.server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[1]


def test_flag_defaults_are_the_config_defaults() -> None:
    """A flag whose default drifts from its ServerConfig field would make `diffcast serve` and the
    tests run different servers."""
    args = build_parser().parse_args(["serve"])
    assert ServerConfig.from_args(args) == ServerConfig()


# Values the generic rule below cannot make up: a parsed or constrained option's text, and the value
# it must become.
SPECIAL_FLAG_VALUES: dict[str, tuple[list[str], Any]] = {
    "policy": (["fifo"], "fifo"),
    "dtype": (["bf16"], "bf16"),
    "forwarded_allow_ips": (["10.0.0.1, 10.0.0.2"], ("10.0.0.1", "10.0.0.2")),
    "worker_delay_ms": (["0,250"], (0.0, 250.0)),
    "osc_port": (["9000"], 9000),
    "osc_reply_port": (["9001"], 9001),
    "ssl_certfile": (["cert.pem", "--ssl-keyfile", "key.pem"], "cert.pem"),
    "ssl_keyfile": (["key.pem", "--ssl-certfile", "cert.pem"], "key.pem"),
    "ndi_out": ([], None), "ndi_in": ([], None), "ndi_allow": ([], None),  # need the ndi extra: test_ndi.py
}


def test_every_server_option_is_one_flag_that_sets_its_field() -> None:
    """Each ServerConfig option is declared once, as a field: `diffcast serve` has its flag, with the
    field's default, and a value given on the command line lands in that field (and no other)."""
    import dataclasses

    flagged = [f for f in dataclasses.fields(ServerConfig) if "flag" in f.metadata]
    assert len(flagged) >= 50
    parser = build_parser()
    default = ServerConfig()
    for item in flagged:
        flag = item.metadata["flag"]
        name = flag.name or "--" + item.name.replace("_", "-")
        if item.name in SPECIAL_FLAG_VALUES:
            extra, want = SPECIAL_FLAG_VALUES[item.name]
            if want is None:
                continue
            argv = [name, *extra]
        elif isinstance(item.default, bool):
            argv, want = [name], not item.default
        elif isinstance(item.default, tuple):
            argv, want = [name, "a", name, "b"], ("a", "b")
        elif isinstance(item.default, int) and not isinstance(item.default, bool):
            argv, want = [name, str(item.default + 3)], item.default + 3
        elif isinstance(item.default, float):
            argv, want = [name, str(item.default + 0.5)], item.default + 0.5
        elif item.default is None and "gib" in item.name:
            argv, want = [name, "2.5"], 2.5
        else:
            argv, want = [name, "some-value-of-32-characters-long"], "some-value-of-32-characters-long"
        config = ServerConfig.from_args(parser.parse_args(["serve", *argv]))
        assert getattr(config, item.name) == want, item.name
        changed = {f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(default, f.name)}
        assert changed <= {item.name, "ssl_certfile", "ssl_keyfile", "https"}, (item.name, changed)


def test_repeatable_flags_become_tuples() -> None:
    args = build_parser().parse_args(
        ["serve", "--ice-server", "stun:a:3478", "--ice-server", "turn:b:3478", "--allowed-origin", "https://x.org",
         "--policy", "fifo", "--max-batch", "2", "--trace-stamp"]
    )
    config = ServerConfig.from_args(args)
    assert config.ice_servers == ("stun:a:3478", "turn:b:3478")
    assert config.allowed_origins == ("https://x.org",)
    assert (config.policy, config.max_batch, config.trace_stamp) == ("fifo", 2, True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--max-streams", "0"], "--max-streams must be at least 1, got 0"),
     (["--state-slots", "-1"], "state_slots must be >= 0, got -1"),
     (["--lanes", "-1"], "--lanes must be between 0 \\(auto\\) and 64, got -1"),
     (["--lanes", "2", "--ray"], "--lanes is for the in-process engine"),
     (["--lanes", "2", "--gpus", "2"], "--lanes is for the in-process engine"),
     (["--device", "cuda"], "CUDA is not available on this machine"),
     (["--device", "tpu"], "use cpu, cuda or cuda:N")],
)
def test_bad_values_exit_with_a_plain_message(argv: list[str], message: str) -> None:
    args = build_parser().parse_args(["serve", *argv])
    with pytest.raises(SystemExit, match=message):
        args._run(args)


def test_rank_zero_runs_the_same_server(monkeypatch: pytest.MonkeyPatch, engine_factory: Any) -> None:
    """`--gpus N` and the single-process path both reach uvicorn through `app.server.app.serve`, with
    the same options (WebSocket frame limit, graceful shutdown, the guarded protocols). The ranks
    are not spawned here: the rank-0 program runs in this process on a stand-in ring."""
    import uvicorn

    import app.server.serving.ranks as ranks
    from app.server.app import serve
    from app.server.edge.http_server import AnsweringWebSocketProtocol, GuardedH11Protocol
    from app.server.serving.engine_bridge import RankFactory

    runs: list[tuple[Any, dict[str, Any]]] = []

    def run(server: uvicorn.Server) -> None:
        c = server.config
        options = {"port": c.port, "ws_max_size": c.ws_max_size, "ws": c.ws, "limits": c.http.limits,
                   "timeout_graceful_shutdown": c.timeout_graceful_shutdown}
        runs.append((c.app, options))

    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setattr(ranks, "loaded_pipeline", lambda model, device: engine_factory.pipeline)
    ring = SimpleNamespace(rt=engine_factory.pipeline.runtime, world=2)  # rank 0 reads the runtime's capabilities
    monkeypatch.setattr(ranks, "run_ring", lambda factory, program, world, **options: program(ring))
    config = ServerConfig(port=9123, max_frame_bytes=1 << 16)

    serve(config, engine_factory)
    before = signal.getsignal(signal.SIGTERM)
    try:
        ranks.serve_ranks(config, 2)
    finally:
        signal.signal(signal.SIGTERM, before)

    (single_app, single), (rank_app, rank) = runs
    assert single == rank
    assert single["port"] == 9123 and single["ws_max_size"] == (1 << 16) + 4096
    assert single["timeout_graceful_shutdown"] == 10 and single["ws"] is AnsweringWebSocketProtocol
    assert single["limits"] == GuardedH11Protocol.limits  # the defaults: ServerConfig's timeouts
    assert isinstance(rank_app.state.manager.factory, RankFactory)
    assert rank_app.state.manager.factory.ring is ring


_TORCH_SEES = """
import os, sys
seen = {}
class Hook:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "torch" not in seen:
            seen["torch"] = os.environ.get("OMP_WAIT_POLICY")
        return None
sys.meta_path.insert(0, Hook())
from app.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(seen.get("torch", "torch not imported"))
"""


@pytest.mark.parametrize(("argv", "policy"), [(["-v", "serve", "--help"], "PASSIVE"), (["stylize", "--help"], "None")])
def test_serve_sets_the_openmp_wait_policy_before_torch_loads(argv: list[str], policy: str) -> None:
    """libgomp reads OMP_WAIT_POLICY once, when torch loads: what torch's import sees is what runs."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", _TORCH_SEES, *argv], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert out.strip().splitlines()[-1] == policy


@pytest.mark.parametrize(("argv", "dtype"), [([], "float32"), (["--dtype", "bf16"], "bfloat16"),
                                            (["--dtype", "fp32"], "float32")])
def test_the_weight_dtype_reaches_the_served_engine(argv: list[str], dtype: str) -> None:
    """`serve --dtype` is what the engine's weights are (auto: fp32 on a CPU, bf16 on CUDA, as the
    benchmarks measure), through the same loader the server uses."""
    from app.server.serving.engine_bridge import InProcessFactory

    config = ServerConfig.from_args(build_parser().parse_args(["serve", "--model", "tiny-random", *argv]))
    factory = InProcessFactory.load(config.model, config.device, config.loras, 1, config.dtype)
    runtime = factory.pipeline.runtime
    assert str(runtime.dit.dtype).removeprefix("torch.") == dtype
    assert {str(p.dtype).removeprefix("torch.") for p in runtime.dit.parameters()} == {dtype}


def test_the_vae_choice_reaches_the_served_engine() -> None:
    """`serve --vae` travels in the server's configuration (not in the model's name, which the profile
    lookup and /api/config show) to the loader the server uses; refused for a model with its own VAE."""
    from app.server.serving.engine_bridge import InProcessFactory
    from engine.vae_choice import SplitVAE

    args = build_parser().parse_args(["serve", "--model", "random:tiny", "--vae", "tiny-random"])
    config = ServerConfig.from_args(args)
    assert (config.model, config.vae) == ("random:tiny", "tiny-random")
    factory = InProcessFactory.load(config.model, config.device, config.loras, 1, config.dtype, config.vae)
    assert isinstance(factory.pipeline.runtime.vae, SplitVAE)
    bad = build_parser().parse_args(["serve", "--model", "tiny-random", "--vae", "tiny-random"])
    with pytest.raises(SystemExit, match="--vae is for Wan 2.1 models"):
        bad._run(bad)


def test_no_playground_serves_without_importing_gradio(tmp_path: Any) -> None:
    """`serve --no-playground`: the app has no /playground route and Gradio is never imported (the GPU
    machines carry the media packages as wheels, and Gradio alone would fill the room they have)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from app.cli import build_parser\n"
        "from app.server.app import create_app\n"
        "from app.server.config import ServerConfig\n"
        "from app.server.serving.engine_bridge import InProcessFactory\n"
        "args = build_parser().parse_args(['serve', '--model', 'tiny-random', '--no-playground'])\n"
        "config = ServerConfig.from_args(args)\n"
        "app = create_app(config, InProcessFactory.load('tiny-random'))\n"
        "paths = [getattr(r, 'path', '') for r in app.routes]\n"
        "print(config.playground, any(p.startswith('/playground') for p in paths), 'gradio' in sys.modules,\n"
        "      any(p.startswith('/api/offer') for p in paths))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False", "False", "True"]
