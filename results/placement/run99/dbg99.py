import copy, sys, torch
sys.path.insert(0, ".")
import stronghold
from tests.engine.helpers import ds_config, run_steps
from tests.engine.test_gpu import ThinModel
torch.manual_seed(0)
model = ThinModel(depth=6)
data = [{"x": torch.randn(2, 16, dtype=torch.bfloat16), "y": torch.randn(2, dtype=torch.bfloat16)} for _ in range(8)]
res = {}
for name, on in (("on", True), ("off", False), ("off2", False)):
    m = copy.deepcopy(model)
    engine, _, _, _ = stronghold.initialize(model=m, blocks=m.blocks, config=ds_config(
        window=2, resident=1, lr=1e-3, gas=2, clip=1e-4, bf16=True, weights_first=True, gpu_previews=on))
    for i in range(0, 8, 2):
        run_steps(engine, data[i:i+2])
        rt = engine.stronghold_runtime
        bad = []
        for idx, st in rt.stores.items():
            T = st.trainable_numel
            w = st.working[:T]; mb = st.master.to(torch.bfloat16)
            d = (w.view(torch.int16) != mb.view(torch.int16)).sum().item()
            if d: bad.append((idx, d))
        print(name, "step", i // 2, "working != master.bf16:", bad, "gpu previews", rt.cpu.stats.gpu_preview_blocks, flush=True)
    masters = rt.master_params()
    res[name] = {n: masters[id(p)].float().cpu() for n, p in engine.module.named_parameters()}
    engine.destroy()
for a, b in (("on", "off"), ("off", "off2")):
    diff = [n for n in res[a] if not torch.equal(res[a][n], res[b][n])]
    print(a, b, "differ:", diff)
