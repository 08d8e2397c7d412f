"""numpy <-> torch without copies, for every dtype zerompi keeps (bfloat16 too).

``torch.from_numpy`` knows neither ``ml_dtypes.bfloat16`` nor a storage that must
stay resizable (``Tensor.numpy()`` marks a storage non-resizable for good, and stage
3 frees a module's storage between uses by resizing it to 0), so both directions go
through a same-width integer view, and a torch storage is read as numpy through its
address.
"""

from __future__ import annotations

import ctypes
import warnings

import numpy as np
import torch

#: numpy dtype name -> torch dtype, for the floats zerompi handles.
_TORCH = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}  # fmt: skip


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of numpy ``dtype`` (float16/32/64, ml_dtypes' bfloat16)."""
    return _TORCH[np.dtype(dtype).name]


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (bfloat16 through an int16 view). A
    read-only array (zerompi's rounded copy) is shared too: it must not be written,
    and torch never writes a parameter's data itself."""
    wanted = torch_dtype(array.dtype)
    raw = array.view(np.int16) if wanted is torch.bfloat16 else array
    with warnings.catch_warnings():  # (torch warns that it cannot make it read-only)
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        tensor = torch.from_numpy(raw)
    return tensor.view(wanted) if wanted is torch.bfloat16 else tensor


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s memory as numpy (a CPU, contiguous tensor; bfloat16 as ml_dtypes')."""
    if tensor.dtype is torch.bfloat16:
        from ..precision import bfloat16

        return tensor.view(torch.int16).numpy().view(bfloat16())
    return tensor.numpy()


def storage_array(flat: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    """The current memory of 1-D ``flat`` as a numpy array of ``dtype``, leaving its
    storage resizable (valid until the storage is next resized)."""
    count = flat.numel()
    if count == 0:
        return np.empty(0, dtype)
    address = flat.data_ptr()
    raw = (ctypes.c_char * (count * flat.element_size())).from_address(address)
    return np.frombuffer(raw, dtype=dtype, count=count)
