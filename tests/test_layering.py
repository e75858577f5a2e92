"""The packages of neox form layers: a module imports only its own layer or lower ones, and no
modules import each other in a circle (a lazy import inside a function counts: it is the same
dependency, only later). Imports under `if TYPE_CHECKING:` count too: an annotation that names a
module is a dependency on it, and a circle through one still ties the modules together.

Layers, lowest first:

    config             schema, loader, derived values; torch-free, imports nothing else of neox
    data tokenizer kernels   readers and kernels the runtime and the planner share
    prep               offline preparation (preprocess, tokenizer training)
    checkpoint.{errors,manifest,find,lock,compat}
                       a checkpoint directory's metadata, torch-free: step directories and
                       `latest`, the manifest and its checksums, the save lock, resume checks
    plan               torch-free planning (attention path, engine choice, estimate, memory,
                       preflight): reads the config, opens data/tokenizer files to check them
    launcher           deepy.py's side: hostfiles, the runner, rank bookkeeping, and
                       what a rank reads to join the job (its environment, a free port)
    model              the plain GPT-NeoX (torch); reads the plan's attention path
    parallel model.transforms
                       what is applied to the built model from outside: tensor/pipeline
                       parallelism (and joining torch.distributed), and the transforms (LoRA,
                       FP8) that wrap its parallel linears
    checkpoint adapters.base_record
                       run checkpoints: save/load, the state by plain name, relayout, reading
                       DeepSpeed's and gpt-neox's files; a LoRA checkpoint's record of its base
    hf adapters        Hugging Face interop (import, export, verify); LoRA adapters' base
    training           the loop and its engines
    inference          generation and evaluation (reuses training's setup)
    entry cli console  the scripts' shared entry points, and what they print

`plan` sits below `model` because it must import without torch: it may never read the model,
while the model may read the plan's decisions.
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    {"config"},
    {"data", "tokenizer", "kernels"},
    {"prep"},
    {f"checkpoint.{m}" for m in ("errors", "ds_files", "manifest", "find", "lock", "compat")},
    {"plan"},
    {"launcher"},
    {"model"},
    {"parallel", "model.transforms"},
    {"checkpoint", "adapters.base_record"},
    {"hf", "adapters"},
    {"training"},
    {"inference"},
    {"entry", "cli", "console", ""},
]
LAYER = {package: i for i, packages in enumerate(LAYERS) for package in packages}
TORCH_FREE = ("config", "plan", *(key for key in LAYER if key.startswith("checkpoint.")))


def modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "neox").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """neox modules `path` imports: at module level, inside functions or for type checking."""

    def resolve(name: str) -> str:
        while name not in known:
            name = name.rpartition(".")[0]
        return name

    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(resolve(a.name) for a in node.names if a.name.startswith("neox."))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("neox"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    found.add(full if full in known else resolve(node.module))
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child])

    visit(ast.parse(path.read_text()).body)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, known) - {name} for name, path in known.items()}


def package(module: str) -> str:
    """The layer key of a module: its package, or package.module where that has a layer."""
    parts = module.split(".")
    if len(parts) > 2 and f"{parts[1]}.{parts[2]}" in LAYER:
        return f"{parts[1]}.{parts[2]}"
    return parts[1] if len(parts) > 1 else ""


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_every_package_has_a_layer():
    missing = {package(m) for m in modules()} - set(LAYER)
    assert not missing, f"packages with no layer in tests/test_layering.py: {missing}"


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, f"modules that import each other in a circle: {found}"


def test_no_upward_imports():
    found = {
        (m, t)
        for m, targets in import_graph().items()
        for t in targets
        if LAYER[package(t)] > LAYER[package(m)]
    }
    upward = sorted(f"{m} imports {t}" for m, t in found)
    assert not upward, "imports against the layer order (tests/test_layering.py):\n" + "\n".join(
        upward
    )


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_config_and_plan_import_without_torch():
    names = sorted(m for m in modules() if package(m) in TORCH_FREE)
    code = (
        f"import importlib, sys\nfor name in {names!r}:\n    importlib.import_module(name)\n"
        "heavy = sorted(m for m in ('torch', 'deepspeed', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
