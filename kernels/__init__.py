"""Fused kernels for BLOOM training: Triton kernels with pure-torch twins, chosen per call by `kernels.registry`.

Model code imports only `kernels.registry`. One module per fused op (layer_norm, bias_gelu, softmax,
flash_attention, cross_entropy), each layered kernel -> launcher -> autograd.Function; `kernels.reference` holds
the torch twins. Launchers start kernels through `kernels.launch`, whose recording mode lets `kernels.aot` compile what
they would launch for sm_80 / sm_90 without a GPU. Nothing here imports `appliance`.
"""
