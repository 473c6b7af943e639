import sample
class FastSampler:
    def __init__(self, kv_cache, threshold):
        self.kv_cache, self.threshold, self.stats = kv_cache, threshold, {}
    def __call__(self, model, prompt_ids, **kw):
        return sample.generate(model, prompt_ids, kv_cache=self.kv_cache, threshold=self.threshold, stats=self.stats, **kw)
    def take_log(self, device):
        out = sample.fast_summary("text", self.stats, device); self.stats = {}; return out
