"""Importing this module installs Transformer Engine's CPU layer for training
(:func:`shardcheck.megatron.cpu.te.install_for_training`).

It is the first module a fork server preloads for ranks that run Megatron with
``--transformer-impl transformer_engine`` (:func:`shardcheck.megatron.cpu.megatron_preload`),
so that the megatron-core modules it preloads next find TE.
"""

from shardcheck.megatron.cpu.te import install_for_training

install_for_training()
