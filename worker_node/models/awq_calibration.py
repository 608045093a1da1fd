"""The built-in calibration text of `vllm-convert --quantization awq` (`--calib-file` replaces it): a few thousand
characters of varied English prose, dialogue, instructions, numbers and code, so that every kind of token a chat
model meets moves the activation statistics AWQ's scale search reads. It is not the text the benchmarks score."""

CALIBRATION_TEXT = """\
The kettle clicked off and Maria poured the water over the coffee grounds, counting slowly to thirty before she
stirred. Outside, the first bus of the morning groaned up the hill, its windows fogged and yellow. She had three
hours before the interview and had already read her notes twice. "You will be fine," her brother had said on the
phone, "just tell them what you told me about the bridge project." The bridge project: eighteen months, two
budgets, one flood, and a city council that changed its mind every spring.

Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant cells, chlorophyll absorbs
mostly red and blue light; the energy splits water molecules, releasing oxygen, and drives the synthesis of ATP and
NADPH. In the Calvin cycle, the enzyme RuBisCO fixes carbon dioxide into a three-carbon sugar, which the plant
uses to build glucose, starch and cellulose. Roughly half of the oxygen in the atmosphere comes from phytoplankton
in the oceans rather than from forests on land.

User: Can you explain what a hash table is?
Assistant: Sure! A hash table stores key-value pairs. It runs each key through a hash function to get an index into
an array of buckets, so looking up a key takes constant time on average. When two keys land in the same bucket (a
collision), the table either chains them in a list or probes for another free slot. Python's dict and Java's
HashMap are both hash tables.
User: What happens when it gets full?
Assistant: It grows: once the load factor passes a threshold, usually around 0.7, it allocates a larger array and
re-inserts every entry.

def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    \"\"\"Merge two sorted lists into one sorted list.\"\"\"
    result, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    return result + a[i:] + b[j:]

Recipe for a simple tomato soup (serves 4): 1 kg ripe tomatoes, 2 onions, 3 cloves of garlic, 750 ml vegetable
stock, 2 tablespoons of olive oil, salt, pepper and a handful of basil. Soften the chopped onions in the oil for
ten minutes, add the garlic for one more, then the tomatoes and the stock. Simmer for 25 minutes, blend until
smooth and season to taste. Serve with bread and a spoon of cream.

In 1969 the Apollo 11 mission landed on the Moon. Neil Armstrong and Buzz Aldrin spent about two and a half hours
outside the lunar module, collecting 21.5 kilograms of rock and soil, while Michael Collins orbited above in the
command module. The flight lasted eight days, three hours and eighteen minutes. Their footprints, undisturbed by
wind or rain, are expected to last for millions of years.

Quarterly report summary: revenue rose 12% year over year to $4.3 million, driven by subscription growth in
Europe (+18%) and Asia (+9%). Operating costs increased 6%, mainly from hiring in support and engineering. Gross
margin improved from 61% to 64%. The board approved a budget of $750,000 for the new data centre in Q3, and the
company expects to reach break-even by the end of next year if churn stays below 3% per month.

SELECT customer_id, COUNT(*) AS orders, SUM(total) AS spent
FROM orders
WHERE created_at >= '2024-01-01'
GROUP BY customer_id
HAVING COUNT(*) > 5
ORDER BY spent DESC
LIMIT 10;

Dear Mr. Okafor, thank you for your letter of 14 March. I am sorry to hear that the replacement part arrived
damaged. We have shipped a new one by express courier, and it should reach you within two working days. Please
keep the damaged part; there is no need to return it. If anything else goes wrong, call me directly at the number
below. With kind regards, Helen Park, Customer Service.

The rules of chess are simple to learn and hard to master. Each player starts with sixteen pieces: one king, one
queen, two rooks, two bishops, two knights and eight pawns. The goal is to checkmate the opposing king, attacking
it so that it has no legal move to escape. Pawns move forward but capture diagonally; knights jump in an L shape;
bishops slide along diagonals and rooks along ranks and files. Castling, en passant and promotion are the three
special moves that beginners most often forget.

Why is the sky blue? Sunlight contains every colour, but as it passes through the atmosphere, the short blue
wavelengths are scattered by nitrogen and oxygen molecules far more than the long red ones, a process called
Rayleigh scattering. We see that scattered blue light coming from every direction. At sunset the light travels
through much more air, most of the blue is scattered away before it reaches us, and the sky glows orange and red.

To install the tool, run `pip install --upgrade mytool`, then create a configuration file at ~/.config/mytool.yaml
with your API key and region. Use `mytool sync --dry-run` first to see which files would change; add `--verbose`
for details, or `--exclude "*.tmp"` to skip temporary files. Errors are written to the log in /var/log/mytool/.
"""
