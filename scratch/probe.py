import gzip, json, glob, os, sys, time, collections
import jax, jax.numpy as jnp, numpy as np
from configs import vlm
from mimo_jax import topology
from mimo_jax.models.mimo import build_modules
from mimo_jax.step import Stepper
out = sys.argv[1]
cfg = vlm.get_config()
for a in sys.argv[2:]:
  k, v = a.split("=")
  obj = cfg
  *ps, last = k.split(".")
  for p in ps: obj = getattr(obj, p)
  setattr(obj, last, type(getattr(obj, last))(v))
topo = topology.build(cfg)
st = Stepper(cfg, topo, build_modules(cfg))
state = st.init_state(0)
sh = topo.sharding("vision")
imgs = jax.device_put(np.random.randint(0, 255, (24, 336, 336, 3), np.uint8), sh)
slots = jax.device_put(np.arange(24, dtype=np.int32), sh)
p = state["vision"].params
acc = st._zeros["vision"](p)
def once(acc):
  embs, sl, vjp = st._enc_fwd["vision"](p, [imgs], [slots])
  return st._enc_bwd["vision"](vjp, [jnp.ones_like(embs[0])], acc)
for _ in range(3): acc = once(acc)
jax.block_until_ready(acc)
t = time.perf_counter()
for _ in range(10): acc = once(acc)
jax.block_until_ready(acc)
dt = (time.perf_counter() - t) / 10
print("vision fwd+bwd 24 images: %.1f ms -> %.0f TFLOP/s" % (dt * 1e3, 24 * 1.165e12 / dt / 1e12))
jax.profiler.start_trace(out, create_perfetto_trace=True)
for _ in range(3): acc = once(acc)
jax.block_until_ready(acc)
jax.profiler.stop_trace()
f = glob.glob(out + "/**/*.trace.json.gz", recursive=True)[0]
tr = json.load(gzip.open(f))
dur = collections.Counter(); cnt = collections.Counter()
for e in tr["traceEvents"]:
  if e.get("ph") == "X" and "args" in e and ("hlo_op" in e["args"] or "kernel" in str(e.get("cat",""))):
    name = e["args"].get("hlo_op", e["name"])
    dur[name] += e["dur"]; cnt[name] += 1
tot = sum(dur.values())
print("device time in ops %.1f ms (3 iters)" % (tot / 1e3))
for n, d in dur.most_common(25):
  print("%6.2f ms %5.1f%% x%d %s" % (d / 3e3, 100 * d / tot, cnt[n] // 3, n[:90]))
