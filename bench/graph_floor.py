"""The floor a chain of dependent kernels in one CUDA graph sets, on the GPU machine (torch).

A decode token is one graph of ~200 dependent kernels; each waits for the previous one. This
times graphs of N tiny dependent kernels (no programmatic dependent launch: torch does not set
it), so the per-kernel cost of the chain itself is known: `python3 bench/graph_floor.py`.
"""
import torch

def per_kernel_us(n, size):
    x = torch.zeros(size, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            x.add_(1.0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(n):
            x.add_(1.0)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 50
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps / n

for size in (1, 2048, 1 << 20):
    for n in (50, 200):
        print(f"graph of {n:4} dependent add_ kernels on {size:8} floats: {per_kernel_us(n, size):6.2f} us per kernel")
