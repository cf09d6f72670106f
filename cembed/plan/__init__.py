"""What a config means on this machine: the device, the precision, the world size, samples per step,
the effective learning rate, the mini-batch — every runtime decision, resolved once into a ``Plan``.

May import: ``cembed.config``, ``cembed.errors`` (torch only inside functions).
"""
