import asyncio, sys
from pathlib import Path
import httpx
from live_server import build_test_app, lora_engine, register_public
import test_request_path as t

async def run(app, key):
    tenancy = app.state.server_tenancy.tenancy
    await tenancy.start()
    body = {"model": "path-adapter","messages": [{"role": "user", "content": "Say something."}],"max_tokens": 8,"stream": True}
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {key}"}
    results = []
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        for i in range(2):
            entered = []
            funcs = {}
            seq = []
            def profile(frame, event, _):
                if event == "call":
                    m = t._module(frame.f_code.co_filename)
                    if m is not None and t._serving(frame):
                        if m not in entered: entered.append(m)
                        funcs.setdefault(m, set()).add(frame.f_code.co_name)
                        if not seq or seq[-1] != m: seq.append(m)
            sys.setprofile(profile)
            async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
                chunks = [l async for l in resp.aiter_lines() if l]
            sys.setprofile(None)
            results.append((entered, funcs, seq))
    await tenancy.close()
    return results

def test_trace(demo_model_dir, demo_adapters, tmp_path):
    engine = lora_engine(demo_model_dir, 16 << 20, max_model_len=256)
    try:
        app = build_test_app(engine, "demo", tmp_path, demo_model_dir)
        register_public(app, "path-adapter", demo_adapters["r8-all"])
        res = asyncio.run(run(app, app.state.server_tenancy.api_key))
    finally:
        asyncio.run(engine.shutdown(0))
    with open("/tmp/trace/out.txt", "w") as f:
        for entered, funcs, seq in res:
            f.write(f"== {len(entered)} modules, {len(seq)} transitions\n")
            for i, m in enumerate(entered, 1):
                f.write(f"{i}. {m}: {sorted(funcs[m])}\n")
            f.write("SEQ: " + " > ".join(s.split('/')[-1][:-3] for s in seq) + "\n")
