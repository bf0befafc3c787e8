"""Every Python block of the guides (docs/torch.md, keras.md, flax.md, verify.md,
disagreement.md) runs as written, on the CPU: the torchrun scripts under ``torchrun
--standalone --nproc-per-node N`` (N from the script's first line; gloo), the others with
``python block.py`` in a temporary folder.

Each block is found by ``(guide, first line)`` in :data:`HOW`, which says how it runs; a
block that is not there fails the test, so a new block cannot go untested. The harness
never edits a block. It may run it through a wrapper (torchvision made importable here,
``tests/torchvision_shim.py``; the process group checked to be really freed at the end,
:func:`doc_blocks.torchrun_wrapper`), and a fragment (a block that uses names the guide
leaves to the reader: ``build_model()``, a dataset) runs after a short setup written here
that defines them, and before a few lines that print what the test checks. A block that
cannot run here is named in :data:`COMPILED_ONLY` with the reason (and the test that runs
those lines, where one does); it is still compiled.

The blocks run two at a time (each about one core), in the order of the tests, while the
tests wait for their own.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

import doc_blocks
from demo.demo_checks import Started

DOCS = doc_blocks.ROOT / "docs"
GUIDES = ("torch", "keras", "flax", "verify", "disagreement")
BIN = Path(sys.executable).parent
TIMEOUT_S = 300  # each block takes 3 to 25 s on 2 idle cores


def python_blocks():
    """``{(guide, first line): text}`` of every ```python block of the guides."""
    found = {}
    for guide in GUIDES:
        for lang, first, body in doc_blocks.blocks(DOCS / f"{guide}.md"):
            if lang == "python":
                assert (guide, first) not in found, f"two blocks of {guide}.md start with {first!r}"
                found[guide, first] = body
    return found


# -- how a block runs ------------------------------------------------------------------


@dataclass
class Way:
    """``command(body, tmp)`` writes what the block needs into ``tmp`` and returns the
    ``(args, env)`` to run there; ``check(tmp, stdout, stderr)`` then asserts what the block
    promises, once the command exited 0."""

    command: Callable[[str, Path], tuple]
    check: Callable[[Path, str, str], None] = lambda tmp, out, err: None


def python(environment=None, wrapper=None, setup="", then=""):
    """``python block.py``: the block, after ``setup`` and before ``then`` where it is a
    fragment, through ``wrapper`` (a script that runs its argument) if given."""

    def command(body, tmp):
        (tmp / "block.py").write_text(f"{setup}\n{body}\n{then}" if setup or then else body)
        args = [sys.executable, "block.py"]
        if wrapper is not None:
            (tmp / "_wrapper.py").write_text(wrapper)
            args.insert(1, "_wrapper.py")
        return args, environment or doc_blocks.env()

    return command


def torchrun(wrapper=None):
    """The script under ``torchrun --standalone --nproc-per-node N`` (N from its first line,
    ``# torchrun --nproc-per-node N NAME.py``), each rank's stdout in its own file, through
    ``wrapper`` (by default :func:`doc_blocks.torchrun_wrapper`: the script's process group
    must be really freed when it ends)."""

    def command(body, tmp):
        match = re.fullmatch(r"# torchrun --nproc-per-node (\d+) (\w+\.py)", body.splitlines()[0])
        assert match, body.splitlines()[0]
        nproc, script = match.groups()
        (tmp / script).write_text(body)
        (tmp / "_ended.py").write_text(wrapper or doc_blocks.torchrun_wrapper())
        return ([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", nproc, "--log-dir", "logs",
                 "--redirects", "1", "_ended.py", script], doc_blocks.env())

    return command


def rank_outputs(tmp):
    """Each rank's stdout, in rank order (torchrun's ``LOG_DIR/RUN/attempt_0/RANK/stdout.log``)."""
    files = sorted(tmp.glob("logs/*/attempt_0/*/stdout.log"), key=lambda f: int(f.parent.name))
    return [f.read_text() for f in files]


def printed(tmp, pattern, ranks):
    """The groups of ``pattern`` matched on the last line each rank printed."""
    outs = rank_outputs(tmp)
    assert len(outs) == ranks, outs
    found = [re.fullmatch(pattern, out.strip().splitlines()[-1]) for out in outs]
    assert all(found), outs
    return [m.groups() for m in found]


# compile.py: a compiled model holds its process group past destroy_process_group() in
# torch 2.13 (docs/torch.md, "Ending a job", "Not yet"). The block is checked for what it
# shows; that the group is still held is checked too, so that the day torch frees it, this
# exception and that paragraph go. The rank then ends with os._exit, past the interpreter
# shutdown where gloo's live threads can abort it, rarely (the same paragraph).
COMPILED_WRAPPER = f"""import os, runpy, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
script = sys.argv[1]
sys.argv = sys.argv[1:]
left_by_script = runpy.run_path(script, run_name="__main__")
import doc_blocks
import torch.distributed as dist
if dist.is_initialized():
    sys.stderr.write(f"{{script}} ended without destroy_process_group()\\n")
    sys.stderr.flush()
    os._exit(3)
if not doc_blocks.gloo_threads():
    sys.stderr.write(f"{{script}}: its group is freed now; drop COMPILED_WRAPPER in tests/test_guides.py and "
                     "update docs/torch.md's 'Not yet' paragraph under 'Ending a job'\\n")
    sys.stderr.flush()
    os._exit(4)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""

SHIM_WRAPPER = doc_blocks.torchrun_wrapper("import torchvision_shim\ntorchvision_shim.install()")

TENSOR = r"tensor\(\[([^\]]*)\]\)"


def check_groups(tmp, out, err):
    """Ranks {0,1} and {2,3}: equal running means within a group, different across."""
    means = [m[1] for m in printed(tmp, rf"(\d) {TENSOR}", 4)]
    assert means[0] == means[1] and means[2] == means[3] and means[0] != means[2], means


def check_compile(tmp, out, err):
    lines = printed(tmp, rf"(\d) {TENSOR}", 2)
    assert [rank for rank, _ in lines] == ["0", "1"] and lines[0][1] == lines[1][1], lines


def check_ckpt(tmp, out, err):
    assert printed(tmp, r"(\d+)", 2) == [("1",), ("1",)]


def check_ddp_amp(tmp, out, err):
    """float32 buffers and weight gradients under bfloat16 autocast, equal running means."""
    lines = printed(tmp, rf"(\d) (torch\.\w+) (torch\.\w+) {TENSOR}", 2)
    assert [line[1:3] for line in lines] == [("torch.float32", "torch.float32")] * 2, lines
    assert lines[0][3] == lines[1][3], lines


def check_precise_bn(tmp, out, err):
    """50 batches used, with the warning that 200 were asked for; the model left in eval mode."""
    assert re.fullmatch(rf"50 {TENSOR} False", out.strip().splitlines()[-1]), out[-500:]
    assert "ran out after 50 of num_batches=200" in err, err[-2000:]


FUSE_SETUP = """import torch, torch.nn as nn
import syncbn
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.LeakyReLU(0.1))"""
FUSE_THEN = """print(sorted({type(m).__name__ for m in model.modules()}))
model(torch.randn(2, 3, 8, 8)).sum().backward()"""


def check_fused(tmp, out, err):
    kinds = out.strip().splitlines()[-1]
    assert "SyncBatchNormAct" in kinds and "BatchNorm2d" not in kinds, kinds


KERAS_ENV = doc_blocks.env(KERAS_BACKEND="tensorflow")
KERAS_MODEL = """import numpy as np
import tensorflow as tf
import keras
import syncbn.keras


def build_model():
    return keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
                             keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])


rng = np.random.default_rng(0)
images, labels = rng.normal(size=(128, 8, 8, 3)).astype("float32"), rng.integers(0, 3, 128)"""
KERAS_FIT_SETUP = KERAS_MODEL + """
train_dataset = tf.data.Dataset.from_tensor_slices((images[:16], labels[:16])).batch(8)"""
KERAS_LOOP_SETUP = KERAS_MODEL + """
dataset = tf.data.Dataset.from_tensor_slices((images, labels))"""
KERAS_THEN = """print(sorted(type(layer).__name__ for layer in model.layers))"""
KERAS_XLA_SETUP = KERAS_MODEL + """
strategy = tf.distribute.MirroredStrategy()
data = tf.data.Dataset.from_tensor_slices((images[:16], labels[:16])).batch(8)"""
KERAS_XLA_THEN = """print(model.jit_compile, sorted(type(layer).__name__ for layer in model.layers))"""


def check_keras_synchronized(tmp, out, err):
    kinds = out.strip().splitlines()[-1]
    assert "'SyncBatchNormalization'" in kinds and "'BatchNormalization'" not in kinds, kinds


def check_keras_xla(tmp, out, err):
    """Compiled with XLA (allow_xla lets it), the layers synchronized."""
    check_keras_synchronized(tmp, out, err)
    assert out.strip().splitlines()[-1].startswith("True "), out[-1000:]


JAX_ENV = doc_blocks.env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
FLAX_CONVERT_SETUP = """import jax, jax.numpy as jnp, flax.linen as nn
import numpy as np
import syncbn.flax

layer = nn.BatchNorm(use_running_average=False, momentum=0.5)   # Flax's own, no axis_name


def train_step(state, batch):
    _, updates = layer.apply(state, batch, mutable=["batch_stats"])
    return {**state, **updates}


batch = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)   # 2 devices x 4 rows x 3 channels
state = jax.tree.map(lambda v: jnp.stack([v, v]), layer.init(jax.random.PRNGKey(0), batch[0]))"""
# momentum 0.5 from a zero mean: the running mean is half the mean of the whole batch, the
# same on both devices (each device's own would differ)
FLAX_CONVERT_THEN = """mean = np.asarray(state["batch_stats"]["mean"])
print(np.array_equal(mean[0], mean[1]), np.allclose(mean[0], 0.5 * np.asarray(batch).reshape(-1, 3).mean(0)))"""
FLAX_BOUNDED_SETUP = """import jax, jax.numpy as jnp


def train_step(x):
    return jax.lax.psum(x, "batch")"""
FLAX_BOUNDED_THEN = """print(train_step(jnp.arange(2.0)).tolist())"""


def check_last_line(expected):
    def check(tmp, out, err):
        assert out.strip().splitlines()[-1] == expected, out[-1000:]

    return check


def verify_command(body, tmp):
    """``mymodels.py`` as written, then the command of verify.md's next block (its required
    arguments)."""
    (tmp / "mymodels.py").write_text(body)
    line = re.search(r"^syncbn verify (\S+) --input-shape (\S+)", (DOCS / "verify.md").read_text(), flags=re.M)
    assert line, "verify.md's command line"
    return [str(BIN / "syncbn"), "verify", line.group(1), "--input-shape", line.group(2)], doc_blocks.env()


def check_verify(tmp, out, err):
    assert "PASS: syncbn reproduces one process on the concatenated batch" in out, out[-3000:]


# in the order they start, the longest first (two run at a time); with no GPU here, the Keras
# blocks' MirroredStrategy() has one replica, the CPU (as README's)
HOW = {
    ("torch", "# torchrun --nproc-per-node 2 compile.py"): Way(torchrun(COMPILED_WRAPPER), check_compile),
    ("torch", "# torchrun --nproc-per-node 4 groups.py"): Way(torchrun(), check_groups),
    ("keras", "import tensorflow as tf"):
        Way(python(KERAS_ENV, setup=KERAS_FIT_SETUP, then=KERAS_THEN), check_keras_synchronized),
    ("verify", "# mymodels.py"): Way(verify_command, check_verify),
    ("torch", "# torchrun --nproc-per-node 2 ddp_amp.py"): Way(torchrun(), check_ddp_amp),
    ("torch", "# torchrun --nproc-per-node 2 ckpt.py"): Way(torchrun(), check_ckpt),
    ("disagreement", "with strategy.scope():"):
        Way(python(KERAS_ENV, setup=KERAS_XLA_SETUP, then=KERAS_XLA_THEN), check_keras_xla),
    ("keras", "strategy = tf.distribute.MirroredStrategy()"):
        Way(python(KERAS_ENV, setup=KERAS_LOOP_SETUP, then=KERAS_THEN), check_keras_synchronized),
    ("torch", "import syncbn.torch.mmengine   # before building: configs' SyncBN is now syncbn.SyncBatchNorm"):
        Way(python()),
    ("torch", "model = syncbn.convert_sync_batchnorm(model)"):
        Way(python(setup=FUSE_SETUP, then=FUSE_THEN), check_fused),
    ("torch", "import lightning.pytorch as L"): Way(python(wrapper=SHIM_WRAPPER)),
    ("torch", "import torch, torch.nn as nn"): Way(python(), check_precise_bn),
    ("flax", 'with syncbn.flax.convert(axis_name="batch"):     # axis_name overrides the layers\' own'):
        Way(python(JAX_ENV, setup=FLAX_CONVERT_SETUP, then=FLAX_CONVERT_THEN), check_last_line("True True")),
    ("torch", "import timm, syncbn"): Way(python(wrapper=SHIM_WRAPPER)),   # strict=True: raises if a BN stays local
    ("flax", "import os"):
        Way(python(JAX_ENV, setup=FLAX_BOUNDED_SETUP, then=FLAX_BOUNDED_THEN), check_last_line("[1.0, 1.0]")),
    ("torch", "import torch"): Way(python()),   # torchvision's import, made to work: no shim of ours
}

# blocks that cannot run here, and why (each is compiled)
COMPILED_ONLY = {
    ("torch", "import contextlib"):
        "a fragment on the reader's transformers `model`; tests/torch/test_transformers.py runs these lines",
    ("torch", "def train_loop_per_worker(config):"):
        "a fragment (`build_model()`, `...`) that starts a Ray cluster; tests/torch/ray_worker.py runs these lines",
    ("torch", "accelerator = accelerate.Accelerator(cpu=True)   # cpu=True on a machine without a GPU"):
        "a fragment of a torchrun script (`build_model()`, `dataset`); tests/torch/accelerate_worker.py runs it",
    ("flax", "import jax, flax.linen as nn"):
        "its last line runs inside jax.pmap or shard_map with the reader's `variables` and `x`, as its comment "
        "says; README's Flax block is that whole program (tests/test_readme.py runs it)",
}


# -- running them two at a time -----------------------------------------------------------


class TwoAtATime:
    """Starts the selected blocks' commands in order, two running at a time; :meth:`result`
    waits for one (starting it first if need be), keeping the other slot busy meanwhile."""

    def __init__(self, make, keys):
        self.make, self.pending, self.started = make, list(keys), {}

    def _fill(self, first=None):
        if first in self.pending:
            self.pending.remove(first)
            self.pending.insert(0, first)
        while self.pending and sum(s.proc.poll() is None for _, s in self.started.values()) < 2:
            key = self.pending.pop(0)
            self.started[key] = self.make(key)

    def result(self, key):
        """``(tmp, stdout, stderr)`` of ``key``'s command once it exited 0 (else fail)."""
        self._fill(key)
        while key not in self.started:
            time.sleep(0.2)
            self._fill(key)
        tmp, started = self.started[key]
        while started.proc.poll() is None and time.monotonic() < started.deadline:
            time.sleep(0.2)
            self._fill()
        out, err = started.finish()
        self._fill()
        return tmp, out, err

    def kill(self):
        for _, started in self.started.values():
            started.kill()


def slug(key):
    """A test id: the guide and the script's name (torchrun) or the first line's start."""
    first = re.sub(r"^# torchrun --nproc-per-node \d+ ", "", key[1])
    return f"{key[0]}-{re.sub(r'[^A-Za-z0-9.]+', '_', first).strip('_')[:32]}"


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    selected = [item.callspec.params["key"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec") and "key" in item.callspec.params]
    found = python_blocks()

    def make(key):
        tmp = tmp_path_factory.mktemp(slug(key))
        args, environment = HOW[key].command(found[key], tmp)
        return tmp, Started(args, tmp, env=environment, timeout=TIMEOUT_S)

    runner = TwoAtATime(make, [key for key in HOW if key in selected and key in found])
    yield runner
    runner.kill()


def test_every_python_block_has_a_way_to_run():
    found = python_blocks()
    assert [key for key in found if key not in HOW and key not in COMPILED_ONLY] == []
    assert [key for key in [*HOW, *COMPILED_ONLY] if key not in found] == []   # none left stale
    assert set(HOW).isdisjoint(COMPILED_ONLY)
    assert len(COMPILED_ONLY) <= len(HOW) // 2   # few exceptions


@pytest.mark.parametrize("key", list(COMPILED_ONLY), ids=slug)
def test_block_that_cannot_run_here_compiles(key):
    compile(python_blocks()[key], f"{key[0]}.md: {key[1]}", "exec")


@pytest.mark.parametrize("key", list(HOW), ids=slug)
def test_block_runs_as_written(key, runs):
    tmp, out, err = runs.result(key)
    HOW[key].check(tmp, out, err)
