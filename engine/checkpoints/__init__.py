"""Reading a model's weights off disk: safetensors files as views of memory
(engine/checkpoints/safetensors_view.py), a checkpoint mapped ahead
(engine/checkpoints/checkpoint_map.py) and the weights cache, the weights as the engine runs
them mapped from one file (engine/checkpoints/weights_cache.py). The architectures that
consume them are in engine/models/.
"""
