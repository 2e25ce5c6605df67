"""Files in granted folders from a Python plugin: plain `open()` inside the
folders the worker's operator granted (WASI preopens), tensors saved and
loaded with `wasmrpc.save` / `wasmrpc.load`. The tests
(`tests/all/python_plugins/files.rs`) grant it folders and try, as an
attacker would, everything a grant must not give.
"""

import csv
import os

import wasmrpc
from wasmrpc import Tensor, remote, torch


@remote
def read_text(path):
    """The text of the file `path`."""
    with open(path) as f:
        return f.read()


@remote
def write_text(path, text):
    """Writes `text` to `path` with `open()`; returns its length."""
    with open(path, "w") as f:
        f.write(text)
    return len(text)


@remote
def write_through_host(path, text):
    """Writes `text` to `path` through the worker (counted against a
    grant's quota)."""
    wasmrpc.write_file(path, text)
    return len(text)


@remote
def list_dir(path):
    """The names in the folder `path`, sorted."""
    return sorted(os.listdir(path))


@remote
def csv_to_safetensors(src, dst):
    """Reads the CSV `src` (a header row of column names, then rows of
    numbers) and saves each column as a float32 tensor to the safetensors
    file `dst`; returns the number of rows."""
    with open(src, newline="") as f:
        rows = list(csv.reader(f))
    header, data = rows[0], rows[1:]
    columns = {
        name: Tensor([float(row[i]) for row in data]) for i, name in enumerate(header)
    }
    wasmrpc.save(columns, dst, metadata={"source": src, "rows": str(len(data))})
    return len(data)


@remote
def load_tensors(path):
    """Every tensor of the file `path`, by name, and its metadata."""
    tensors, metadata = wasmrpc.load_with_metadata(path)
    return (tensors, metadata)


@remote
def save_ones(path, n):
    """Saves `ones(n)` as the tensor `ones` to `path`."""
    wasmrpc.save({"ones": torch.ones(n)}, path)
    return n


@remote
def imports_inside_and_the_time():
    """Imports inside a function (the build preloads them) and reads the
    wall clock (the host's): `(year >= 2026, the JSON module's name)`."""
    import datetime
    import json

    return (datetime.datetime.now().year >= 2026, json.__name__)
