"""cuDNN's graph-API runtime fusion of conv + bias + [residual add] + relu (NHWC), timed per plan against
what torchfuse's unfused path costs (ATen's channels-last convolution without bias, plus one in-place pass
over its output, which moves the epilogue's bytes), on the convolutions of resnet50, vgg16 and
mobilenet_v3_large, in float32 (TF32 allowed), float16 and bfloat16; each plan's error against float64.
Uses cudnn-frontend's Python API (`pip install --no-deps nvidia-cudnn-frontend==1.16.0`), not torchfuse:
it is how the fused plans were chosen as a candidate (docs/kernels/conv_add_act.md).

    python bench/cudnn_fusion_probe.py relu,add_relu        # MAXPLANS=4 (default 6); writes cudnn_probe.json in $OUT or .
"""
import json, os, sys, time
import torch
import torch.nn.functional as F
import cudnn

torch.manual_seed(0)
dev = "cuda"
handle = cudnn.create_handle()
cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
print("cudnn backend", cudnn.backend_version(), "torch cudnn", torch.backends.cudnn.version(), flush=True)


def bench(fn, reps=20, rounds=5):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record(); e.synchronize()
        times.append(s.elapsed_time(e) / reps * 1000)
    times.sort()
    return times[len(times) // 2]


CD = {torch.float32: cudnn.data_type.FLOAT, torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}

# name, N, C, H, K, R, stride, pad, groups
SHAPES = [
    ("r50.stem", 32, 3, 224, 64, 7, 2, 3, 1),
    ("r50.1x1.64-64.56", 32, 64, 56, 64, 1, 1, 0, 1),
    ("r50.3x3.64.56", 32, 64, 56, 64, 3, 1, 1, 1),
    ("r50.1x1.64-256.56", 32, 64, 56, 256, 1, 1, 0, 1),
    ("r50.3x3.128.28", 32, 128, 28, 128, 3, 1, 1, 1),
    ("r50.1x1.1024-256.14", 32, 1024, 14, 256, 1, 1, 0, 1),
    ("r50.3x3.512.7", 32, 512, 7, 512, 3, 1, 1, 1),
    ("vgg.3x3.64.224", 16, 64, 224, 64, 3, 1, 1, 1),
    ("vgg.3x3.256.56", 16, 256, 56, 256, 3, 1, 1, 1),
    ("vgg.3x3.512.28", 16, 512, 28, 512, 3, 1, 1, 1),
    ("mb.dw3x3.240.28", 64, 240, 28, 240, 3, 1, 1, 240),
    ("mb.1x1.40-240.28", 64, 40, 28, 240, 1, 1, 0, 1),
]
ACTS = sys.argv[1].split(",") if len(sys.argv) > 1 else ["relu"]
MAXPLANS = int(os.environ.get("MAXPLANS", "6"))
rows = []
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for (name, N, C, H, K, R, s, p, g) in SHAPES:
        for act in ACTS:
            row = {"shape": name, "dtype": str(dtype).split(".")[-1], "act": act}
            try:
                x = torch.randn(N, C, H, H, device=dev, dtype=dtype).to(memory_format=torch.channels_last)
                w = (torch.randn(K, C // g, R, R, device=dev, dtype=dtype) / (C // g * R * R) ** 0.5).to(memory_format=torch.channels_last)
                b = torch.randn(K, device=dev, dtype=dtype)
                y = F.conv2d(x, w, None, s, p, 1, g)
                other = torch.randn_like(y) if act == "add_relu" else None
                row["conv_us"] = bench(lambda: F.conv2d(x, w, None, s, p, 1, g))
                row["pass_us"] = bench(lambda: y.relu_())  # one read+write of the output: the epilogue's traffic
                b4 = b.view(1, -1, 1, 1)
                if act == "relu":
                    ref = torch.relu(F.conv2d(x.double(), w.double(), b.double(), s, p, 1, g))
                elif act == "silu":
                    ref = F.silu(F.conv2d(x.double(), w.double(), b.double(), s, p, 1, g))
                else:
                    ref = torch.relu(F.conv2d(x.double(), w.double(), b.double(), s, p, 1, g) + other.double())
                t0 = time.time()
                graph = cudnn.pygraph(io_data_type=CD[dtype], intermediate_data_type=cudnn.data_type.FLOAT,
                                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
                X = graph.tensor(name="X", dim=list(x.shape), stride=list(x.stride()), data_type=CD[dtype])
                W = graph.tensor(name="W", dim=list(w.shape), stride=list(w.stride()), data_type=CD[dtype])
                B = graph.tensor(name="B", dim=[1, K, 1, 1], stride=[K, 1, K, K], data_type=CD[dtype])
                Y = graph.conv_fprop(image=X, weight=W, padding=[p, p], stride=[s, s], dilation=[1, 1],
                                     compute_data_type=cudnn.data_type.FLOAT)
                Z = graph.bias(input=Y, bias=B)
                O = None
                if act == "relu":
                    Z = graph.relu(input=Z)
                elif act == "silu":
                    Z = graph.swish(input=Z)
                else:
                    O = graph.tensor(name="O", dim=list(other.shape), stride=list(other.stride()), data_type=CD[dtype])
                    Z = graph.relu(input=graph.add(a=Z, b=O))
                Z.set_output(True).set_data_type(CD[dtype])
                graph.validate()
                graph.build_operation_graph()
                graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                graph.check_support()
                n = graph.get_execution_plan_count()
                row["plans"] = n
                out = torch.full_like(y, float("nan"))
                pack = {X: x, W: w, B: b, Z: out}
                if O is not None:
                    pack[O] = other
                best = None
                tried = []
                for i in range(min(n, MAXPLANS)):
                    tb = time.time()
                    try:
                        graph.build_plan_at_index(i)
                    except Exception as ex:
                        tried.append({"i": i, "error": str(ex)[:120]})
                        continue
                    ws = torch.empty(max(1, graph.get_workspace_size_plan_at_index(i)), device=dev, dtype=torch.uint8)
                    out.fill_(float("nan"))
                    graph.execute_plan_at_index(pack, ws, i, handle=handle)
                    torch.cuda.synchronize()
                    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                    t = bench(lambda: graph.execute_plan_at_index(pack, ws, i, handle=handle))
                    tried.append({"i": i, "name": graph.get_plan_name_at_index(i), "us": t, "build_s": time.time() - tb, "err": err})
                    if best is None or t < best["us"]:
                        best = tried[-1]
                row["tried"] = tried
                row["fused_best_us"] = best["us"] if best else None
                row["fused_plan0_us"] = tried[0].get("us") if tried else None
                row["setup_s"] = time.time() - t0
                eager_ref = torch.relu(F.conv2d(x, w, b, s, p, 1, g)) if act == "relu" else None
                if eager_ref is not None:
                    row["eager_err"] = ((eager_ref.double() - ref).abs().max() / ref.abs().max()).item()
            except Exception as ex:
                row["error"] = (type(ex).__name__ + ": " + str(ex))[:300]
            rows.append(row)
            tb = row.get("fused_best_us")
            print(f"{row['dtype']:9s} {name:22s} {act:8s} conv {row.get('conv_us', 0):8.1f} pass {row.get('pass_us', 0):7.1f} "
                  f"fused best {tb if tb is None else round(tb, 1)} plan0 {row.get('fused_plan0_us')} plans {row.get('plans')} "
                  f"setup {row.get('setup_s', 0):.1f}s err {[round(t.get('err', -1), 6) for t in row.get('tried', [])][:3]} eager_err {row.get('eager_err')} "
                  f"{row.get('error', '')}", flush=True)
            if row.get("tried"):
                print("    ", [(t.get("name", "")[:40], round(t.get("us", -1), 1)) for t in row["tried"]], flush=True)
            json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "cudnn_probe.json"), "w"), indent=1)
