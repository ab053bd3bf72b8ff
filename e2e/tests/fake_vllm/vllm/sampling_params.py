"""fake vllm.sampling_params"""
import enum


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    def __init__(self, max_tokens=16, ignore_eos=False, temperature=1.0, detokenize=True,
                 output_kind=RequestOutputKind.CUMULATIVE):
        self.max_tokens, self.ignore_eos, self.temperature = max_tokens, ignore_eos, temperature
        self.detokenize, self.output_kind = detokenize, output_kind
