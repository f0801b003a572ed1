"""What a learner takes to work: torch-only files, run or copied as they are. Nothing here
imports zero_lab (tests/test_fsdp2_script.py holds that).

    fsdp2_train.py   FSDP2 training from meta-device init to a DCP checkpoint resumed on
                     another world size, run by torchrun; notebook 09 ends by running it
    deepspeed/       zero1.json, zero2.json, zero3.json: DeepSpeed 0.19.8 configs, one per
                     stage, each key explained in deepspeed/README.md, loaded by DeepSpeed's
                     own config code and raced against one process on CPU
                     (tests/test_deepspeed_configs.py)
    cheat_sheet.md   one page: stage -> bytes held and sent -> FSDP2 -> DeepSpeed -> Megatron-LM
    glossary.md      every term the notebooks use
"""
