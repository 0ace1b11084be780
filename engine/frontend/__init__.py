"""The engine's front ends: what the gateway holds a model's engine by (`EngineClient`,
`EngineFacts`), the loop that serves it in a thread of this process (`AsyncEngine`) or in an
engine process of its own (`EngineProcess`, its main, warm spares, the zygote), and offline
batch generation (`LLM`). They drive the engine core (engine.llm_engine and what it runs),
which imports none of them; engine.messages, the boundary's types, names `EngineFacts`.
"""
