"""CUDA tests: everything here is marked `cuda` and skipped on machines without a GPU."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(skip)
