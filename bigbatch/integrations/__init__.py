"""bigbatch inside other trainers: callbacks for Hugging Face ``Trainer`` and Lightning.

Each trainer has its own module, which imports that trainer when it is imported, so
``import bigbatch`` (and this package) needs neither:

- ``bigbatch.integrations.huggingface``: ``NoiseScaleCallback`` (a
  ``transformers.TrainerCallback``) and ``lr_find(trainer)``;
- ``bigbatch.integrations.lightning``: ``NoiseScaleCallback`` (a ``lightning.pytorch``
  ``Callback``; it also grows ``accumulate_grad_batches`` between epochs) and
  ``lr_find(module, dataloader)``.

The trainer-neutral part (what is kept of the first micro-batch, the estimate, the
doubling decision) is `bigbatch.integrations.probe`, which needs torch only.
"""

__all__: list[str] = []
