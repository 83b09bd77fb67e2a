"""LoRA: the adapter a layer owns, and peft models taken as they are.

- adapter.py: `Adapter`, `LoraAdapter`, `ExpertAdapter`, their sharding from the base's style
  (`lora_splits`, `attach_lora`), `trainable_parameters`; `LoraConfig` lives in config.py.
- peft.py: peft LoRA models unwrapped for `parallelize`, their adapters kept.

Nothing is imported here (as in every folder): `qm.LoraConfig` and `qm.trainable_parameters`
load their modules on use.
"""
