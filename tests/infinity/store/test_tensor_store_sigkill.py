"""A store's swap file does not outlive its process, even one killed with SIGKILL."""


CHILD_WITH_STORE = """
import torch
from infinity.store import TensorStore
store = TensorStore({"nvme": 48 << 20}, nvme_path=DIRECTORY)
store.put("w", torch.ones(1 << 20), "nvme")
print("holding", flush=True)
"""


def test_sigkilled_store_leaves_no_swap_file(small_tmpfs, tmp_path, sigkilled_child):
    directory = small_tmpfs("96m")
    slack = 0
    if directory is None:  # not root: tmp_path's shared file system, which others may use
        directory, slack = tmp_path, 16 << 20
    code = CHILD_WITH_STORE.replace("DIRECTORY", repr(str(directory)))
    before, alive, after, names = sigkilled_child(code, directory)
    assert alive - before >= (48 << 20) - slack, "the store's swap file took no space: test broken"
    assert names == []
    assert after <= before + slack, f"{after - before} bytes still used after the child died"
