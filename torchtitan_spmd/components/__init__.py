"""Upstream's ``torchtitan.components`` import paths for the model converters: ``quantization``
(``Float8LinearConverter``, ...) and ``lora`` (``LoRAConverter``). The converters are the techniques
:mod:`torchtitan_spmd.techniques.quantization` and :mod:`torchtitan_spmd.techniques.lora`."""
