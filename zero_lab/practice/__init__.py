"""What a learner takes to work: torch-only files, run or copied as they are. Nothing here
imports zero_lab (tests/test_fsdp2_script.py holds that).

    fsdp2_train.py   FSDP2 training from meta-device init to a DCP checkpoint resumed on
                     another world size, run by torchrun; notebook 09 ends by running it
"""
