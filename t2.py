import torch
torch.set_num_threads(1)
import ksana_llm as kt
from ksana_llm.generation_config import GenerationConfig
g = torch.Generator().manual_seed(2)
prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 13, 22, 30, 9, 17)]
cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True)
model = kt.Model.from_pretrained("model", device="cpu", dtype="float32", progress=False)
with kt.Engine(model, generation_config=cfg) as eng:
    ref = [o.token_ids for o in eng.generate_outputs(prompts, use_tqdm=False)]
for kw in [dict(num_device_blocks=12, block_token_num=4), dict(num_device_blocks=14, block_token_num=4, split_fuse_token_num=8),
           dict(num_device_blocks=12, block_token_num=4, enable_prefix_caching=False)]:
    model = kt.Model.from_pretrained("model", device="cpu", dtype="float32", progress=False)
    with kt.Engine(model, generation_config=cfg, **kw) as eng:
        outs = [o.token_ids for o in eng.generate_outputs(prompts, use_tqdm=False)]
        st = eng.stats()
    print(kw, [a == b for a, b in zip(outs, ref)], {k: v for k, v in vars(st).items() if 'preempt' in k or 'swap' in k} if hasattr(st, '__dict__') else st)
