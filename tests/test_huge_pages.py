"""flopwise puts PyTorch's large CPU tensors on transparent huge pages (flopwise/__init__.py): a CPU
step allocates and frees its logits every step, and in 4 KB pages each one faults in again."""

import subprocess
import sys
from pathlib import Path

import pytest

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
FAULTS = """
import resource, flopwise, torch
x = torch.ones(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.ones(8 << 20)  # 32 MB, allocated and freed like a step's logits
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="the kernel has no transparent huge pages")
@pytest.mark.slow
def test_a_steps_large_tensors_fault_in_huge_pages():
    def faults(*env: str) -> int:
        r = subprocess.run(
            ["env", *env, sys.executable, "-c", FAULTS], capture_output=True, text=True, timeout=120, check=True
        )
        return int(r.stdout)

    default, opted_out = faults(), faults("THP_MEM_ALLOC_ENABLE=0")
    assert opted_out > 20 * 8000  # 4 KB pages: 8,192 faults a tensor
    assert default < opted_out / 5, (default, opted_out)  # measured here: 10,587 against 163,879
