/* Drafting in C: the suffix drafter's speculation tree over the request's own tokens.
 *
 * What `SuffixDrafter` builds in Python from its per-request suffix trie (drafters/suffix.py),
 * computed from the context itself, with no trie to keep up to date: the trie's node for a
 * string s is the set of positions where s ends in the context, and count(s) is its size.
 *
 *   L[e]         = the length of the longest common suffix of c[0..e] and the whole context c,
 *                  capped at D - 1: s = c[n-m..n-1] ends at e exactly when L[e] >= m
 *   node(p)      = { e : L[e] >= m }            for the pattern p of the context's last m tokens
 *   node(s + t)  = { e + 1 : e in node(s), c[e + 1] = t }
 *   prob(s + t)  = prob(s) * |node(s + t)| / |node(s)|
 *
 * The trie holds strings of at most D tokens, so a node of length D has no children. The rest
 * is `expand` and `best_tree` step for step: for every m a best-first tree of at most
 * budget(m) nodes (frontier ties by insertion order, children in token order), nodes of prob
 * below min_prob never added, at most max_len deep; the tree of highest score (sum of probs,
 * summed in insertion order) wins, the longer match on ties. The same floating-point
 * operations in the same order, so the same tree as the Python trie's, which the tests check.
 *
 * One pass over the context (L) and work proportional to the matches: no per-token upkeep, so
 * a drafter that was not consulted for some steps pays nothing to catch up.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double prob;
    int64_t order;   /* insertion counter: equal probs leave first in, first out */
    int32_t token;
    int32_t parent;  /* tree index of the parent, -1 below the match */
    int32_t depth;   /* depth below the match (1 for the match's children) */
    int32_t first;   /* its end positions: pool[first .. first + count) */
    int32_t count;
} Frontier;

/* Frontier order: the larger prob first, then the earlier insertion. */
static int before(const Frontier *a, const Frontier *b) {
    if (a->prob != b->prob) return a->prob > b->prob;
    return a->order < b->order;
}

static void heap_push(Frontier *heap, int *size, Frontier item) {
    int i = (*size)++;
    while (i > 0) {
        int up = (i - 1) / 2;
        if (!before(&item, &heap[up])) break;
        heap[i] = heap[up];
        i = up;
    }
    heap[i] = item;
}

static Frontier heap_pop(Frontier *heap, int *size) {
    Frontier top = heap[0], last = heap[--(*size)];
    int i = 0;
    for (;;) {
        int child = 2 * i + 1;
        if (child >= *size) break;
        if (child + 1 < *size && before(&heap[child + 1], &heap[child])) child++;
        if (!before(&heap[child], &last)) break;
        heap[i] = heap[child];
        i = child;
    }
    if (*size > 0) heap[i] = last;
    return top;
}

typedef struct { int32_t token, position; } Next;

static int by_token_then_position(const void *a, const void *b) {
    const Next *x = a, *y = b;
    if (x->token != y->token) return x->token < y->token ? -1 : 1;
    return (x->position > y->position) - (x->position < y->position);
}

typedef struct {
    const int64_t *context;
    int64_t n;
    int max_depth, max_len, single_path;
    double min_prob;
    int32_t *pool;   /* end positions of every node pushed */
    int64_t pool_used, pool_size;
    Next *next;      /* scratch: one node's continuations */
    Frontier *heap;
    int64_t heap_capacity;
    int heap_size;
    int64_t order;
} Expansion;

/* Grow a buffer to hold `needed` items of `size` bytes (doubling); -1 when out of memory. */
static int reserve(void **buffer, int64_t *capacity, int64_t needed, size_t size) {
    if (needed <= *capacity) return 0;
    int64_t grown = *capacity * 2 > needed ? *capacity * 2 : needed;
    void *moved = realloc(*buffer, grown * size);
    if (!moved) return -1;
    *buffer = moved;
    *capacity = grown;
    return 0;
}

/* Push the children of a node (its end positions pool[first .. first + count), `depth` below a
 * match of `match_len`) onto the frontier. Returns -1 when out of memory. */
static int push_children(Expansion *x, int match_len, int32_t first, int32_t count,
                         double prob, int32_t index, int32_t depth) {
    if (depth >= x->max_len || match_len + depth >= x->max_depth) return 0;
    int kept = 0;
    for (int32_t i = 0; i < count; i++) {
        int64_t e = x->pool[first + i];
        if (e + 1 < x->n) {
            x->next[kept].token = (int32_t)x->context[e + 1];
            x->next[kept].position = (int32_t)(e + 1);
            kept++;
        }
    }
    if (kept == 0) return 0;
    qsort(x->next, kept, sizeof(Next), by_token_then_position);
    /* Every child pushed takes its end positions from these and one frontier slot. */
    if (reserve((void **)&x->pool, &x->pool_size, x->pool_used + kept, sizeof(int32_t)) < 0 ||
        reserve((void **)&x->heap, &x->heap_capacity, x->heap_size + kept, sizeof(Frontier)) < 0)
        return -1;
    int best_start = -1, best_count = 0;
    for (int start = 0; start < kept;) {
        int end = start;
        while (end < kept && x->next[end].token == x->next[start].token) end++;
        if (x->single_path) {  /* only the most frequent child (ties: the smaller token) */
            if (end - start > best_count) { best_start = start; best_count = end - start; }
            start = end;
            continue;
        }
        double child_prob = prob * (double)(end - start) / (double)count;
        if (child_prob >= x->min_prob) {
            Frontier item = {child_prob, x->order++, x->next[start].token, index, depth + 1,
                             (int32_t)x->pool_used, end - start};
            for (int j = start; j < end; j++) x->pool[x->pool_used++] = x->next[j].position;
            heap_push(x->heap, &x->heap_size, item);
        }
        start = end;
    }
    if (x->single_path && best_start >= 0) {
        double child_prob = prob * (double)best_count / (double)count;
        if (child_prob >= x->min_prob) {
            Frontier item = {child_prob, x->order++, x->next[best_start].token, index, depth + 1,
                             (int32_t)x->pool_used, best_count};
            for (int j = best_start; j < best_start + best_count; j++)
                x->pool[x->pool_used++] = x->next[j].position;
            heap_push(x->heap, &x->heap_size, item);
        }
    }
    return 0;
}

/* The best speculation tree over the context's own tokens (see the header). Writes at most
 * max_nodes nodes to tokens/parents/probs and the winning match length to *match_len_out;
 * returns the node count (0: no tree), or -1 when out of memory. */
int dresd_suffix_context_tree(const int64_t *context, int64_t n, int max_depth, double factor,
                              double offset, int max_nodes, double min_prob, int max_len,
                              int single_path, int32_t *tokens, int32_t *parents, double *probs,
                              int32_t *match_len_out) {
    *match_len_out = 0;
    if (n < 1 || max_nodes < 1 || max_len < 1) return 0;
    int max_match = max_depth - 1 < n ? max_depth - 1 : (int)n;
    /* L[e], capped at max_match; L[n-1] = max_match. */
    int32_t *common = malloc(sizeof(int32_t) * n);
    Expansion x = {context, n, max_depth, max_len, single_path, min_prob};
    x.pool_size = n + 256;  /* grown on demand (`reserve`) */
    x.pool = malloc(sizeof(int32_t) * x.pool_size);
    x.next = malloc(sizeof(Next) * n);
    x.heap_capacity = 256;
    x.heap = malloc(sizeof(Frontier) * x.heap_capacity);
    int32_t *grown_tokens = malloc(sizeof(int32_t) * max_nodes * 3);
    int32_t *grown_parents = grown_tokens + max_nodes;
    int32_t *grown_first = grown_parents + max_nodes;
    double *grown_probs = malloc(sizeof(double) * max_nodes);
    int result = 0;
    if (!common || !x.pool || !x.next || !x.heap || !grown_tokens || !grown_probs) {
        result = -1;
        goto done;
    }
    int64_t last = context[n - 1];
    for (int64_t e = 0; e < n; e++) {
        int l = 0;
        if (context[e] == last)
            while (l < max_match && e - l >= 0 && context[e - l] == context[n - 1 - l]) l++;
        common[e] = l;
    }
    double best_score = 0.0;
    int best_nodes = 0;
    for (int m = 1; m <= max_match; m++) {
        int budget = (int)(m * factor + offset + 1e-6);
        if (budget > max_nodes) budget = max_nodes;
        if (budget <= 0) continue;
        /* The match node: every end position of the pattern. */
        x.pool_used = 0;
        x.heap_size = 0;
        x.order = 0;
        int32_t root_count = 0;
        for (int64_t e = 0; e < n; e++)
            if (common[e] >= m) x.pool[x.pool_used++] = (int32_t)e;
        root_count = (int32_t)x.pool_used;
        if (push_children(&x, m, 0, root_count, 1.0, -1, 0) < 0) { result = -1; goto done; }
        int grown = 0;
        double score = 0.0;
        while (x.heap_size > 0 && grown < budget) {
            Frontier node = heap_pop(x.heap, &x.heap_size);
            grown_tokens[grown] = node.token;
            grown_parents[grown] = node.parent;
            grown_first[grown] = node.first;
            grown_probs[grown] = node.prob;
            grown++;
            if (push_children(&x, m, node.first, node.count, node.prob, grown - 1,
                              node.depth) < 0) { result = -1; goto done; }
        }
        for (int i = 0; i < grown; i++) score += grown_probs[i];
        if (grown > 0 && score >= best_score) {
            best_score = score;
            best_nodes = grown;
            *match_len_out = m;
            memcpy(tokens, grown_tokens, sizeof(int32_t) * grown);
            memcpy(parents, grown_parents, sizeof(int32_t) * grown);
            memcpy(probs, grown_probs, sizeof(double) * grown);
        }
    }
    result = best_nodes;
done:
    free(common);
    free(x.pool);
    free(x.next);
    free(x.heap);
    free(grown_tokens);
    free(grown_probs);
    return result;
}
