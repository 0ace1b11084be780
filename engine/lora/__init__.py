"""LoRA adapters inside the engine: what an adapter is (engine/lora/types.py), the slots, CPU
cache and loader thread that place them (engine/lora/manager.py), and the pool their weights
live in (engine/lora/pool.py).
"""
