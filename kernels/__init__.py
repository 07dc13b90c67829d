"""Fused kernels for BLOOM training: Triton kernels with pure-torch twins, chosen per call by `kernels.registry`.

Model code imports only `kernels.registry`. One module per fused op (layer_norm, bias_gelu, softmax,
flash_attention, cross_entropy), each layered kernel -> launcher -> autograd.Function; `kernels.reference` holds
the torch twins. Nothing here imports `appliance`.
"""
