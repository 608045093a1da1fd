"""The scheduler's speculation: which requests propose in a step, their proposals, and what their results taught.

With async scheduling the next plan is built before this one's tokens are known, and a proposal needs them: a
request that speculates therefore runs one plan at a time (it is held until its result is applied, and a plan
built while it has a token in flight leaves it out). Requests that do not speculate (opted out, paused for low
acceptance, or all of them while the batch is too big) keep async scheduling's overlap.

While some request speculates, the engine runs one plan at a time: a plan built while a token of any running
request is in flight is empty (`begin_step` sets `wait`). Left to themselves, the speculating requests would fall
out of phase (one whose result came back joins the plan built while the others' step runs) and take turns, and a
request that does not speculate would run alone in the plans between theirs: steps of 1 or 2 requests that read
every weight as a step of 4 does, for a fraction of the tokens, each delaying the next verify step. In lockstep
every step holds every request; what is lost is the overlap of the scheduler's work with the step (milliseconds
against a step of tens).
"""

from __future__ import annotations

import logging

from proto.wire import StepResult
from scheduler_node.core.in_flight import SentPlan
from scheduler_node.core.proposers import Proposer, make_proposer
from scheduler_node.core.request import Request, Status
from scheduler_node.core.speculative import SpecCounters, eligible
from settings.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer: Proposer = make_proposer(config)
        self.counters = SpecCounters()
        self.active = True  # this step's batch is small enough to speculate (`begin_step`)
        self.lockstep = False  # some request speculates: plans run one at a time (`begin_step`)
        self.wait = False  # some request speculates and a token is in flight: this plan is empty (`begin_step`)

    def admit(self, req: Request) -> None:
        """A new request keeps its speculation state only if the worker can verify its proposals exactly."""
        if req.spec is not None and not eligible(req.sampling):
            req.spec = None

    def begin_step(self, running: list[Request]) -> None:
        self.active = len(running) <= self.config.disable_by_batch_size
        # Passes over at most disable_by_batch_size requests, and none at all while the policy is off.
        self.lockstep = self.active and any(r.spec is not None and not r.spec.pause for r in running)
        self.wait = self.lockstep and any(r.num_placeholders for r in running)

    def drafts(self, req: Request, limit: int) -> list[int] | None:
        """The tokens `req` proposes in this plan, a decode of a request the workers hold: at most `limit` (and k);
        [] for none; None to leave it out of this plan (it speculates, and its last token is still in flight)."""
        spec = req.spec
        if not self.active or spec is None:
            return []
        if spec.pause:  # proposals mostly rejected lately: it decodes normally (and asynchronously) for a while
            spec.pause -= 1
            return []
        if req.num_placeholders:
            return None
        k = min(self.config.num_speculative_tokens, limit)
        return self.proposer.propose(req, spec, k) if k > 0 else []

    def to_draft(self, requests: list[Request], samples: list[bool]) -> list[int]:
        """The handles of a plan's requests whose next proposals the worker's draft model makes after this step:
        those that sample and would speculate in their next step (none while the policy is off)."""
        if not (self.active and self.proposer.on_worker):
            return []
        return [r.handle for r, s in zip(requests, samples) if s and r.spec is not None and not r.spec.pause]

    def drafted(self, req: Request, tokens: list[int]) -> None:
        """The worker's draft proposals for `req`, made after the tokens it has now."""
        if req.spec is not None:
            req.spec.drafted = tokens
            req.spec.drafted_at = req.num_tokens

    def observe(self, req: Request, proposed: int, accepted: int) -> None:
        """A speculated step's result: `accepted` of its `proposed` tokens were the target model's."""
        self.counters.record(proposed, accepted)
        if req.spec is not None:
            req.spec.observe(proposed, accepted)

    def settle(self, sent: SentPlan, result: StepResult) -> None:
        """Each speculated request's proposals: the result's tokens are the accepted ones and one more; the
        rejected ones' KV slots are not computed after all (both sides roll back: the worker as it verified).
        Their blocks stay the request's, to be written by its next steps (as vLLM's do)."""
        for i, (req, proposed) in enumerate(zip(sent.requests, sent.drafts)):
            if not proposed:
                continue
            tokens = result.tokens_of(req.handle)
            accepted = len(tokens) - 1 if tokens else 0
            rejected = proposed - accepted
            sent.ends[i] -= rejected
            sent.tokens[i] -= rejected
            if req.status is Status.RUNNING and req.num_preemptions == sent.runs[i]:
                req.num_computed_tokens -= rejected
                self.observe(req, proposed, accepted)

    @staticmethod
    def room(req: Request, budget: int, max_model_len: int) -> int:
        """Proposals a decode of `req` may add: within the step's budget, before max_tokens (the step samples one
        more token than it proposes) and max_model_len (each proposal takes a KV slot)."""
        return min(
            budget - 1,
            req.stop.max_tokens - len(req.output_token_ids) - 1,
            max_model_len - req.num_tokens,
        )
