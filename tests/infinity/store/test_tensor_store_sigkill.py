"""A store's swap file does not outlive its process, even one killed with SIGKILL."""


CHILD_WITH_STORE = """
import torch
from infinity.store import TensorStore
store = TensorStore({"nvme": 48 << 20}, nvme_path=DIRECTORY)
store.put("w", torch.ones(1 << 20), "nvme")
print("holding", flush=True)
"""


def test_sigkilled_store_leaves_no_swap_file(sigkilled_child_frees):
    sigkilled_child_frees(CHILD_WITH_STORE, "96m", 48 << 20)
