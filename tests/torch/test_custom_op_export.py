"""A program exported with a kernreg custom op loads and runs in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("kernreg_ops")

EXPORT = """
import sys, torch
import kernreg.torch, kernreg_ops.ops
rms = kernreg.torch.as_custom_op(kernreg_ops.ops.rmsnorm)
class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))
    def forward(self, x):
        return rms(x, self.w, 1e-6)
x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
ep = torch.export.export(Norm(), (x,))
torch.export.save(ep, sys.argv[1])
torch.save(ep.module()(x), sys.argv[2])
"""

LOAD = """
import sys{first}
assert 'kernreg_ops' not in sys.modules
import torch{second}
ep = torch.export.load(sys.argv[1])
(node,) = [n for n in ep.graph.nodes if n.op == 'call_function']
assert str(node.target) == 'kernreg.layernorm_rmsnorm.default', node.target
record = node.meta['custom']['kernreg']
assert record == {{'op': 'layernorm.rmsnorm', 'implementation': 'aten', 'rule': 'priority'}}, record
x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
torch.testing.assert_close(ep.module()(x), torch.load(sys.argv[2]), rtol=0, atol=0)
print('ok')
"""


def _run(code: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def exported(
    tmp_path_factory: pytest.TempPathFactory, once_per_session: Callable[..., Any]
) -> tuple[str, str]:
    """The saved program and its expected output, exported once by a fresh process."""

    def export() -> tuple[str, str]:
        folder = tmp_path_factory.mktemp("export")
        program, expected = str(folder / "norm.pt2"), str(folder / "expected.pt")
        _run(EXPORT, program, expected)
        return program, expected

    program, expected = once_per_session("exported_program", export)
    return program, expected


@pytest.mark.parametrize("kernreg_first", [True, False])
def test_exported_program_loads_in_a_fresh_process(
    exported: tuple[str, str], kernreg_first: bool
) -> None:
    program, expected = exported
    first, second = (
        ("\nimport kernreg.torch", "") if kernreg_first else ("", "\nimport kernreg.torch")
    )
    assert _run(LOAD.format(first=first, second=second), program, expected).strip() == "ok"


def test_without_kernreg_the_saved_program_does_not_load(exported: tuple[str, str]) -> None:
    program, _ = exported
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    out = subprocess.run(
        [sys.executable, "-c", "import sys, torch; torch.export.load(sys.argv[1])", program],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode != 0
    assert "kernreg.layernorm_rmsnorm" in out.stderr


ROTARY_BY_ID = """
import torch
import kernreg, kernreg.torch
from kernreg import KernelSpec
from kernreg.torch import input_spec
ran = []
def rotary_fast(positions, q, k, cos_sin_cache, is_neox=True):
    ran.append(q.dtype)
    from kernreg_ops.reference import rotary
    return rotary(positions, q, k, cos_sin_cache, is_neox)
kernreg.register_kernel(
    KernelSpec("embedding.rotary", "fast", rotary_fast, requires=["cpu"], dtypes=["float32"], priority=50)
)
kernreg.default_registry().ensure_plugins()
args, kwargs = input_spec("embedding.rotary").load()(torch.float32, torch.device("cpu"), 0)
assert args[0].dtype == torch.int64  # positions comes first
torch.ops.kernreg.embedding_rotary(*args, **kwargs)  # defined from the op id on lookup
kernreg.torch.as_custom_op("embedding.rotary")(*args, **kwargs)
print(ran)
"""


def test_a_custom_op_made_from_an_op_id_dispatches_on_what_the_op_declares() -> None:
    # embedding.rotary's calls dispatch on q (its op object says so; the generator declares
    # it): made from the op id alone, as a saved program's node is when it loads, the
    # custom op must not decide on the integer positions and so always run the reference.
    assert _run(ROTARY_BY_ID).strip() == "[torch.float32, torch.float32]"
