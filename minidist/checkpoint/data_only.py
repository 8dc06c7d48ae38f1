"""A checkpoint is data, never code: a sharded checkpoint read without running anything it names.

A pickle is not a data format but a small program for a stack machine. Two of its instructions
make it dangerous: GLOBAL names any importable object (`os.system`, `builtins.exec`), and REDUCE
calls it with arguments from the file. `pickle.load` runs that program as it reads, before the
caller sees a single object. So whoever hands over a checkpoint that is unpickled runs their code
on your cluster, with your credentials, on every rank.

`torch.load(..., weights_only=True)` closes that door for `torch.save` files: its unpickler
admits only tensors and plain containers. Every `torch.load` in minidist passes it. PyTorch's
distributed checkpoint (DCP) does not, in two places:

- `FileSystemReader.read_metadata` reads `dcp/.metadata` (which file holds which slice of which
  tensor) with a plain `pickle.load`;
- `DefaultLoadPlanner.load_bytes` reads every non-tensor entry of the state dict (the torch
  optimizer's learning rate, betas, ...) with `torch.load(weights_only=False)`.

The checksums in `checkpoint.json` do not help: they catch a disk's or a copy's accident, not an
attacker, who recomputes them as easily as minidist computed them (plain SHA-256, the manifest
beside the files). So minidist reads a sharded checkpoint through its own two pieces instead:

- `DataOnlyReader`, a `FileSystemReader` whose `read_metadata` unpickles with `MetadataUnpickler`:
  its `find_class` admits only the names in `ALLOWED`, the types DCP's metadata is made of (found
  by unpickling the metadata of minidist's own checkpoints: DDP, ZeRO-1/2, FSDP, HSDP, CPU offload,
  LoRA, bf16, and PyTorch's DDP, FSDP2 and HSDP), and refuses any other name, unimported and
  uncalled. It reads the same file DCP would, the global `.metadata` or a rank's own, through the
  same file-system layer.
- `DataOnlyPlanner`, a `DefaultLoadPlanner` whose `load_bytes` uses `weights_only=True`.

**Inside the checkpoint, never outside.** Even built of admitted types alone, the metadata says
which file DCP opens for each item (`_StorageInfo.relative_path`), where in it (`offset`) and how
many bytes (`length`); DCP joins the path to the folder, so an absolute one or one with `..` would
read another run's shard (every checksum of the folder's own files still holding), a FIFO would
block the read forever, and a claimed length of a terabyte would be allocated before reading. So
the reader checks, before DCP sees it (`_inside`): every path relative and plain, a regular file of
the folder (no link, no pipe), every piece within its file's size, and every tensor's chunk list a
list of chunks. `state.verify` then refuses a file the metadata names that the manifest does not list.

`check` reads the metadata up front, so that `state.verify` refuses a planted payload in one line
before the model loads; `load` is `dcp.load` through both pieces (the folder could change between
the check and the load: the reader refuses then too).
"""

import os
import pickle
import stat
from pathlib import PurePosixPath

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # private, as DefaultLoadPlanner uses it
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, StorageMeta,
                                                   TensorStorageMetadata)

from minidist.runtime.errors import UsageError

# (module, name) pairs, exactly: "PosixPath" is admitted, "PosixPath.touch" (a method, reachable
# through the same module) is not. Each is a plain record, a dtype, a shape, or a path: building
# one runs no code of the file's choosing.
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},  # which file, offset and length hold an item
    "torch.serialization": {"_get_layout"},  # "torch.strided" -> the layout object (as weights_only admits it)
    "torch": {"Size"} | {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)},
    "pathlib": {"PosixPath"},  # the checkpoint_id DCP records in StorageMeta
}


class NotData(pickle.UnpicklingError):
    """A checkpoint names something that is not data (a function, a class outside `ALLOWED`)."""


class Outside(ValueError):
    """The metadata sends a read outside the checkpoint's own files, or past their ends."""


def plain_relative(name) -> bool:
    """Is `name` a path inside a folder: relative, with no `..`, `.` or empty part, nothing to resolve?"""
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    return bool(parts) and not name.startswith("/") and "\\" not in name and \
        all(part not in ("..", ".") for part in parts) and "/".join(parts) == name


def regular_file_inside(folder, name: str) -> os.stat_result | None:
    """The stat of `folder/name` if every step of `name` is a real folder or, last, a regular file
    (no link, pipe or device on the way); None otherwise."""
    path = os.fspath(folder)
    for part in PurePosixPath(name).parts:
        path = os.path.join(path, part)
        try:
            found = os.lstat(path)
        except OSError:
            return None
        if stat.S_ISLNK(found.st_mode):
            return None
    return found if stat.S_ISREG(found.st_mode) else None


def files_named(metadata: Metadata, folder) -> set[str]:
    """The files `metadata` sends DCP to, each checked (module doc): raise `Outside` for the first
    one outside the folder, not a regular file, or read past its end; or a chunk list that is not one."""
    sizes = {}
    for index, where in (getattr(metadata, "storage_data", None) or {}).items():
        name = getattr(where, "relative_path", None)
        if not plain_relative(name):
            raise Outside(f"its item {index.fqn} is read from {name!r}, which is not a file inside the checkpoint")
        if name not in sizes:
            found = regular_file_inside(folder, name)
            if found is None:
                raise Outside(f"its item {index.fqn} is read from {name}, which is not a regular file of the checkpoint")
            sizes[name] = found.st_size
        offset, length = getattr(where, "offset", None), getattr(where, "length", None)
        if not all(type(n) is int and n >= 0 for n in (offset, length)) or offset + length > sizes[name]:
            raise Outside(f"its item {index.fqn} claims bytes {offset}+{length} of {name}, which has {sizes[name]}")
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata) and not (
                type(item.chunks) is list and all(type(c) is ChunkStorageMetadata for c in item.chunks)):
            raise Outside(f"its entry {fqn} lists chunks that are not chunks")
    return set(sizes)


class MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only the names in `ALLOWED` (see module doc)."""

    def find_class(self, module: str, name: str):
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise NotData(f"it names {module}.{name}, which is not part of a checkpoint's metadata")


class DataOnlyReader(FileSystemReader):
    """DCP's file-system reader, its metadata unpickled by `MetadataUnpickler` (see module doc)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if hasattr(self, "_get_metadata_path"):  # newer torch: `.metadata`, or a rank's own `__<rank>.metadata`
            path = self._get_metadata_path(kwargs.get("rank"))
        else:
            path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as stream:
            metadata = MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise NotData(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
        self.files = files_named(metadata, self.path)  # before DCP opens any of them
        if getattr(metadata, "storage_meta", None) is None:  # what FileSystemReader.read_metadata does too
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor entries read with `weights_only=True`."""

    def load_bytes(self, read_item, value) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:  # weights_only's refusal, in a paragraph: keep the line that names it
            named = [line.strip() for line in str(err).splitlines() if "GLOBAL" in line]
            raise NotData(f"its entry {read_item.dest_index.fqn} is not plain data "
                          f"({named[0] if named else 'refused by weights_only'})") from None
        if self.flatten_state_dict:  # the rest is DefaultLoadPlanner.load_bytes as it is
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def refusal(folder, why) -> str:
    """The one line that says a checkpoint was refused for naming code (`why`: NotData's text)."""
    return (f"checkpoint {folder} is not plain data: {why}; a checkpoint is data, never code, so nothing in it "
            f"was loaded or run; resume only from a checkpoint you wrote or trust")


def damaged(folder, why) -> str:
    """The one line that says a checkpoint's metadata sends a read outside its files (`why`: Outside's text)."""
    return (f"checkpoint {folder} is damaged: its .metadata {why}; nothing was read; resume from another "
            f"checkpoint or start afresh without --resume")


def check(folder) -> set[str]:
    """Read `folder`'s DCP metadata (`folder/.metadata`) as `load` will; raise ValueError, one line,
    if it names anything outside `ALLOWED`, is not DCP's Metadata, or sends a read outside the
    folder's files (`files_named`). Returns the files it names, relative to `folder`."""
    reader = DataOnlyReader(folder)
    try:
        reader.read_metadata()
        return reader.files
    except NotData as err:
        raise ValueError(refusal(folder, err)) from None
    except Outside as err:
        raise ValueError(damaged(folder, err)) from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, IndexError) as err:
        raise ValueError(f"checkpoint {folder} is damaged: its .metadata cannot be read ({type(err).__name__}); "
                         f"resume from another checkpoint or start afresh without --resume") from None


def saved_keys(folder) -> set[str]:
    """The keys (flattened, `optimizer.step`...) `folder`'s DCP metadata holds, read as `check` reads it."""
    return set(DataOnlyReader(folder).read_metadata().state_dict_metadata)


def load(state: dict, folder) -> None:
    """`dcp.load(state, checkpoint_id=folder)` through `DataOnlyReader` and `DataOnlyPlanner`;
    a refusal on any rank is a UsageError of one line on every rank (DCP gathers the failures)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=DataOnlyReader(folder), planner=DataOnlyPlanner())
    except NotData as err:
        raise UsageError(refusal(folder, err)) from None
    except Outside as err:
        raise UsageError(damaged(folder, err)) from None
    except CheckpointException as err:
        failures = [exc for exc, _ in err.failures.values()]
        refused = [exc for exc in failures if isinstance(exc, NotData)]
        if refused:
            raise UsageError(refusal(folder, refused[0])) from None
        outside = [exc for exc in failures if isinstance(exc, Outside)]
        if outside:
            raise UsageError(damaged(folder, outside[0])) from None
        # DCP's planner compares every saved tensor's whole shape with this run's before it reads
        # (a sharded checkpoint of another tensor-parallel layout, say): one line, not its traceback.
        shapes = [exc for exc in failures if "Size mismatch" in str(exc)]
        if shapes:
            raise UsageError(f"checkpoint {folder} holds tensors of other shapes than this run's ({shapes[0]}): "
                             f"it was written by another layout; resume it with the sizes that wrote it "
                             f"(--tp_size), or start afresh without --resume") from None
        # A key this run asks for that the checkpoint lacks: another strategy's or layout's pieces.
        missing = [exc for exc in failures if "Missing key in checkpoint state_dict" in str(exc)]
        if missing:
            raise UsageError(f"checkpoint {folder} lacks a piece this run holds ({str(missing[0]).strip()}): it was "
                             f"written by another layout; resume it with the --tp_size and --pp_size that wrote it, "
                             f"or start afresh without --resume") from None
        raise
