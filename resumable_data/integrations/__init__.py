"""Thin adapters for the trainers people already use; each is imported on its own, never here.

- ``resumable_data.integrations.transformers``: ``ResumableTrainer``, ``ResumableTrainerMixin``.
- ``resumable_data.integrations.accelerate``: ``skip_first_batches`` in O(1), ``batch_sampler_of``.
- ``resumable_data.integrations.lightning``: ``ResumeCallback``.
- ``resumable_data.integrations.deepspeed``: ``client_state`` / ``load_client_state`` for DeepSpeed's checkpoints.
- ``resumable_data.integrations.torchtitan``: ``TitanLoader``, a torchtitan data loader, and ``dataloader_config``.

Each module imports its framework (the DeepSpeed one needs none, the torchtitan one only in
``dataloader_config``), so ``import resumable_data`` never does.
"""
