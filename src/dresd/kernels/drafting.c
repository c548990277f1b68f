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
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
    Expansion x = {.context = context, .n = n, .max_depth = max_depth, .max_len = max_len,
                   .single_path = single_path, .min_prob = min_prob};
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

/* ---------------------------------------------------------------------------------------------
 * Hybrid's candidate tree (drafters/hybrid.py, `CandidateTree` and `HybridDrafter._cut` /
 * `_learn`), on flat arrays: merge every source's candidates into one trie, estimate each
 * node's reach from the acceptance table, keep the tree that maximises expected tokens per unit
 * of verify cost, and later score its nodes against the tokens the step emitted. Node features
 * and the table's cells as there; a cell is one integer (`hybrid_cell`), the table three arrays
 * indexed by it. The same float operations in the same order as the Python, which the tests
 * check node for node.
 * ------------------------------------------------------------------------------------------- */

/* The tree's columns, each `capacity` int32 long, one block: node 0 is the root. */
enum { T_TOKEN, T_PARENT, T_DEPTH, T_SOURCES, T_SUPPORT, T_VOTES, T_SHARE, T_FIRST_KID,
       T_NEXT_SIBLING, T_LAST_KID, T_COLUMNS };

#define COLUMN(tree, capacity, column) ((tree) + (int64_t)(column) * (capacity))

static int share_bucket(double share) { return share < 0.4 ? 0 : share < 0.8 ? 1 : 2; }

static int support_bucket(int neighbours) {
    return neighbours == 0 ? 0 : neighbours == 1 ? 1 : neighbours < 4 ? 2 : 3;
}

/* A node's cell: (sources bitmask, support bucket, depth 1-4, first, share bucket + 1). */
static int hybrid_cell(const int32_t *tree, int capacity, int node, int first) {
    int depth = COLUMN(tree, capacity, T_DEPTH)[node];
    if (depth > 4) depth = 4;
    int cell = COLUMN(tree, capacity, T_SOURCES)[node];
    cell = cell * 4 + support_bucket(COLUMN(tree, capacity, T_SUPPORT)[node]);
    cell = cell * 4 + depth - 1;
    cell = cell * 2 + first;
    return cell * 4 + COLUMN(tree, capacity, T_SHARE)[node] + 1;
}

/* The child most candidates pass through (the earliest on ties); -1 if none. */
static int first_child(const int32_t *tree, int capacity, int node) {
    const int32_t *votes = COLUMN(tree, capacity, T_VOTES);
    const int32_t *next = COLUMN(tree, capacity, T_NEXT_SIBLING);
    int best = -1;
    for (int kid = COLUMN(tree, capacity, T_FIRST_KID)[node]; kid >= 0; kid = next[kid])
        if (best < 0 || votes[kid] > votes[best]) best = kid;
    return best;
}

/* Merge candidates into the tree (which holds `nodes` nodes, 1: the root alone): candidate c is
 * tokens[offsets[c] .. offsets[c + 1]), cut to max_len, from the source of bit sources[c], with
 * neighbours[c] neighbours and per-token count shares (NaN: none). Returns the node count, or
 * -1 when the tree is full. */
static int dresd_hybrid_merge(int32_t *tree, int capacity, int nodes, const int64_t *tokens,
                              const int64_t *offsets, int candidates, const int64_t *sources,
                              const int64_t *neighbours, const double *shares, int max_len) {
    int32_t *token = COLUMN(tree, capacity, T_TOKEN), *parent = COLUMN(tree, capacity, T_PARENT);
    int32_t *depth = COLUMN(tree, capacity, T_DEPTH), *mask = COLUMN(tree, capacity, T_SOURCES);
    int32_t *support = COLUMN(tree, capacity, T_SUPPORT);
    int32_t *votes = COLUMN(tree, capacity, T_VOTES), *share = COLUMN(tree, capacity, T_SHARE);
    int32_t *first = COLUMN(tree, capacity, T_FIRST_KID);
    int32_t *next = COLUMN(tree, capacity, T_NEXT_SIBLING);
    int32_t *last = COLUMN(tree, capacity, T_LAST_KID);
    if (nodes == 0) {  /* the root */
        token[0] = -1; parent[0] = -1; depth[0] = 0; mask[0] = 0; support[0] = 0; votes[0] = 0;
        share[0] = -1; first[0] = -1; next[0] = -1; last[0] = -1;
        nodes = 1;
    }
    for (int c = 0; c < candidates; c++) {
        int64_t length = offsets[c + 1] - offsets[c];
        if (max_len >= 0 && length > max_len) length = max_len;
        int32_t vote = neighbours[c] > 1 ? (int32_t)neighbours[c] : 1;
        int node = 0;
        for (int64_t position = 0; position < length; position++) {
            int32_t t = (int32_t)tokens[offsets[c] + position];
            int child = first[node];
            while (child >= 0 && token[child] != t) child = next[child];
            if (child < 0) {
                if (nodes >= capacity) return -1;
                child = nodes++;
                token[child] = t; parent[child] = node; depth[child] = depth[node] + 1;
                mask[child] = 0; support[child] = 0; votes[child] = 0; share[child] = -1;
                first[child] = -1; next[child] = -1; last[child] = -1;
                if (last[node] >= 0) next[last[node]] = child; else first[node] = child;
                last[node] = child;
            }
            mask[child] |= (int32_t)sources[c];
            support[child] += (int32_t)neighbours[c];
            votes[child] += vote;
            double s = shares[offsets[c] + position];
            if (s == s) {  /* not NaN */
                int bucket = share_bucket(s);
                if (bucket > share[child]) share[child] = bucket;
            }
            node = child;
        }
    }
    return nodes;
}

/* reach[v] = P(verification reaches v), from the table's p(cell) = (accepted + strength *
 * prior) / (tried + strength); siblings scaled to sum to at most 1. */
static void dresd_hybrid_reach(const int32_t *tree, int capacity, int nodes,
                               const double *accepted, const double *tried,
                               const double *prior, double strength, double *reach) {
    const int32_t *next = COLUMN(tree, capacity, T_NEXT_SIBLING);
    reach[0] = 1.0;
    for (int node = 0; node < nodes; node++) {  /* parents come before children */
        int kid = COLUMN(tree, capacity, T_FIRST_KID)[node];
        if (kid < 0) continue;
        int top = first_child(tree, capacity, node);
        double total = 0.0;
        for (int v = kid; v >= 0; v = next[v]) {
            int cell = hybrid_cell(tree, capacity, v, v == top);
            reach[v] = (accepted[cell] + strength * prior[cell]) / (tried[cell] + strength);
            total += reach[v];
        }
        double scale = 1.0 / total < 1.0 ? 1.0 / total : 1.0;
        for (int v = kid; v >= 0; v = next[v]) reach[v] = reach[node] * reach[v] * scale;
    }
}

static __thread const double *sort_reach;  /* qsort's key: reach descending, then node ascending */

static int by_reach(const void *a, const void *b) {
    int x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (sort_reach[x] != sort_reach[y]) return sort_reach[x] > sort_reach[y] ? -1 : 1;
    return (x > y) - (x < y);
}

/* The cut: the max_nodes most probable nodes, of which the first n with n maximising
 * (1 + their reach summed) / costs[n + 1] are kept (n = 0: nothing). Writes the kept nodes'
 * leaves to leaves, in the order of a walk from the root that visits each node's kept children
 * most probable first (reach, then node): so the first draft follows the most probable child at
 * every depth, and each node's rank among its siblings in the drafts (what the batch budget
 * prices under load) is its rank by reach. Returns the leaf count and sets *kept_out = n.
 * order, first and next: scratch of `nodes` entries. */
static int dresd_hybrid_cut(const int32_t *tree, int capacity, int nodes, const double *reach,
                            const double *costs, int max_nodes, int32_t *order, int32_t *first,
                            int32_t *next, int32_t *leaves, int *kept_out) {
    for (int v = 1; v < nodes; v++) order[v - 1] = v;
    sort_reach = reach;
    qsort(order, nodes - 1, sizeof(int32_t), by_reach);
    int ranked = nodes - 1 < max_nodes ? nodes - 1 : max_nodes;
    double summed = 0.0, best = 1.0 / costs[1];  /* 1 + the reach summed, as numpy's cumsum */
    int kept = 0;
    for (int n = 1; n <= ranked; n++) {
        summed += reach[order[n - 1]];
        double ratio = (1.0 + summed) / costs[n + 1];
        if (ratio > best) { best = ratio; kept = n; }
    }
    *kept_out = kept;
    /* Each kept node's kept children, most probable first: prepended from the least. */
    const int32_t *parent = COLUMN(tree, capacity, T_PARENT);
    for (int v = 0; v < nodes; v++) first[v] = -1;
    for (int i = kept - 1; i >= 0; i--) {
        int v = order[i];
        next[v] = first[parent[v]];
        first[parent[v]] = v;
    }
    int count = 0, v = first[0];
    while (v > 0) {  /* depth first; a node with no kept child is a leaf */
        if (first[v] >= 0) { v = first[v]; continue; }
        leaves[count++] = v;
        while (v > 0 && next[v] < 0) v = parent[v];
        if (v > 0) v = next[v];
    }
    return count;
}

/* Score the tree's nodes against the tokens the step emitted (the accepted path, then the
 * bonus token): every child of a node on the path is a trial of its cell, accepted if its
 * token came. lost[s] (-1 when none): the accepted tokens lost without source bit s, from the
 * first accepted node it alone proposed on. */
static void dresd_hybrid_learn(const int32_t *tree, int capacity, const int64_t *emitted,
                               int count, double *accepted, double *tried, int32_t *lost,
                               int sources) {
    const int32_t *token = COLUMN(tree, capacity, T_TOKEN);
    const int32_t *mask = COLUMN(tree, capacity, T_SOURCES);
    const int32_t *next = COLUMN(tree, capacity, T_NEXT_SIBLING);
    for (int s = 0; s < sources; s++) lost[s] = -1;
    int node = 0, accepted_tokens = count - 1;  /* the last one is the bonus token */
    for (int depth = 0; depth < count; depth++) {
        int top = first_child(tree, capacity, node), found = -1;
        for (int kid = COLUMN(tree, capacity, T_FIRST_KID)[node]; kid >= 0; kid = next[kid]) {
            int cell = hybrid_cell(tree, capacity, kid, kid == top);
            int hit = token[kid] == emitted[depth];
            accepted[cell] += hit;
            tried[cell] += 1;
            if (hit) found = kid;
        }
        node = found;
        if (node < 0) break;
        int m = mask[node];
        if (depth < accepted_tokens && m && !(m & (m - 1))) {  /* one source alone */
            int s = __builtin_ctz(m);
            if (lost[s] < 0) lost[s] = accepted_tokens - depth;
        }
    }
}

/* A hybrid step in one call, for the cost of one call from Python: first learn from the last
 * step (where last_tree is not NULL: `dresd_hybrid_learn` with its emitted tokens), then merge
 * this step's candidates into an empty tree (`dresd_hybrid_merge`), estimate the reach of its
 * nodes (`dresd_hybrid_reach`) and cut it (`dresd_hybrid_cut`). Everything Python reads back
 * goes into one flat record of int32, which it turns into lists with one call: the tree's
 * nodes, the nodes kept, lost[s] for each of the num_sources source bits (-1 when none: the
 * accepted tokens the last step lost without it), then each kept leaf's path from the root's
 * child down as its length followed by its tokens (room: 2 + num_sources + max_nodes *
 * (max_len + 1)). Its scratch is allocated here: from Python each array costs ~4 us with the
 * caches a forward leaves. Returns the record's length, or -1 when the tree is full or memory
 * runs out. */
int dresd_hybrid_draft(const int32_t *last_tree, int last_capacity, const int64_t *emitted,
                       int emitted_count, int num_sources, int32_t *tree, int capacity,
                       const int64_t *tokens, const int64_t *offsets, int candidates,
                       const int64_t *sources, const int64_t *neighbours, const double *shares,
                       int max_len, double *accepted, double *tried, const double *prior,
                       double strength, const double *costs, int max_nodes, int32_t *record) {
    int32_t *lost = record + 2, *path = record + 2 + num_sources;
    for (int s = 0; s < num_sources; s++) lost[s] = -1;
    if (last_tree)
        dresd_hybrid_learn(last_tree, last_capacity, emitted, emitted_count, accepted, tried,
                           lost, num_sources);
    record[0] = record[1] = 0;
    int nodes = dresd_hybrid_merge(tree, capacity, 0, tokens, offsets, candidates, sources,
                                   neighbours, shares, max_len);
    if (nodes < 0) return -1;
    record[0] = nodes;
    if (nodes < 2) return (int)(path - record);
    /* reach (double), order, first, next and leaves (int32): capacity entries each */
    double *reach = malloc((size_t)capacity * (sizeof(double) + 4 * sizeof(int32_t)));
    if (!reach) return -1;
    int32_t *order = (int32_t *)(reach + capacity), *first = order + capacity;
    int32_t *next = first + capacity, *leaves = next + capacity;
    dresd_hybrid_reach(tree, capacity, nodes, accepted, tried, prior, strength, reach);
    int kept = 0;
    int count = dresd_hybrid_cut(tree, capacity, nodes, reach, costs, max_nodes, order, first,
                                 next, leaves, &kept);
    record[1] = kept;
    const int32_t *token = COLUMN(tree, capacity, T_TOKEN);
    const int32_t *parent = COLUMN(tree, capacity, T_PARENT);
    const int32_t *depth = COLUMN(tree, capacity, T_DEPTH);
    for (int i = 0; i < count; i++) {  /* a kept leaf's depth is at most max_len */
        int length = depth[leaves[i]];
        path[0] = length;
        for (int node = leaves[i], at = length; node > 0; node = parent[node], at--)
            path[at] = token[node];
        path += 1 + length;
    }
    free(reach);
    return (int)(path - record);
}

/* ---------------------------------------------------------------------------------------------
 * The most frequent prefixes of many continuations (drafters/prefixes.py) and REST's lookup in
 * a suffix array (drafters/rest.py, datastore/sparse.py), in one call each.
 * ------------------------------------------------------------------------------------------- */

static __thread int64_t row_width;  /* qsort's key: rows of row_width int32, compared in order */

static int by_row(const void *a, const void *b) {
    const int32_t *x = a, *y = b;
    for (int64_t i = 0; i < row_width; i++)
        if (x[i] != y[i]) return x[i] < y[i] ? -1 : 1;
    return 0;
}

typedef struct { int32_t depth, row, count; } PrefixNode;

/* Rank: count descending, then the order nodes are listed in (depth, then first row). */
static int by_count(const void *a, const void *b) {
    const PrefixNode *x = a, *y = b;
    if (x->count != y->count) return x->count > y->count ? -1 : 1;
    if (x->depth != y->depth) return x->depth < y->depth ? -1 : 1;
    return (x->row > y->row) - (x->row < y->row);
}

/* `most_frequent_prefixes`: rows [m, width] of positive symbols, each followed by zeros (at
 * least one symbol), sorted here unless `sorted`. The prefixes ranked first by (count
 * descending, length ascending, symbols ascending), `max_nodes` of them, form a trie; its
 * leaves, in rank order, are written as (row, depth) pairs: the leaf is rows[row][:depth] of
 * the sorted rows (sorted in place). Returns the leaf count, -1 when out of memory. */
int dresd_frequent_prefixes(int32_t *rows, int64_t m, int64_t width, int sorted, int max_nodes,
                            int32_t *leaf_rows, int32_t *leaf_depths) {
    if (m <= 0 || width <= 0 || max_nodes <= 0) return 0;
    if (!sorted) {
        row_width = width;
        qsort(rows, m, sizeof(int32_t) * width, by_row);
    }
    /* lcp[i]: the common prefix length of rows i-1 and i (padding included, as numpy's) */
    int32_t *lcp = malloc(sizeof(int32_t) * m);
    PrefixNode *nodes = malloc(sizeof(PrefixNode) * m * width);
    if (!lcp || !nodes) { free(lcp); free(nodes); return -1; }
    lcp[0] = 0;
    for (int64_t i = 1; i < m; i++) {
        int64_t l = 0;
        while (l < width && rows[i * width + l] == rows[(i - 1) * width + l]) l++;
        lcp[i] = (int32_t)l;
    }
    /* Depth d's nodes are the runs of rows between places where lcp < d; a run whose first row
     * ends before d is no node. */
    int64_t count = 0;
    for (int64_t d = 1; d <= width; d++) {
        for (int64_t i = 0; i < m;) {
            int64_t j = i + 1;
            while (j < m && lcp[j] >= d) j++;
            if (rows[i * width + d - 1] != 0)
                nodes[count++] = (PrefixNode){(int32_t)d, (int32_t)i, (int32_t)(j - i)};
            i = j;
        }
    }
    qsort(nodes, count, sizeof(PrefixNode), by_count);
    int64_t kept = count < max_nodes ? count : max_nodes;
    /* A kept node is a leaf when no kept node one deeper starts inside its run. */
    int leaves = 0;
    for (int64_t a = 0; a < kept; a++) {
        int has_child = 0;
        for (int64_t b = 0; b < kept && !has_child; b++)
            has_child = nodes[b].depth == nodes[a].depth + 1 && nodes[b].row >= nodes[a].row &&
                        nodes[b].row < nodes[a].row + nodes[a].count;
        if (!has_child) {
            leaf_rows[leaves] = nodes[a].row;
            leaf_depths[leaves] = nodes[a].depth;
            leaves++;
        }
    }
    free(lcp);
    free(nodes);
    return leaves;
}

/* A suffix of the text (big-endian symbols of `width` bytes, so bytes compare as symbols)
 * against a pattern: < 0, 0 when the suffix starts with the pattern, > 0. */
static int compare_suffix(const uint8_t *text, int64_t bytes, int64_t offset,
                          const uint8_t *pattern, int64_t length) {
    if (offset < 0 || offset > bytes) return 1;  /* a damaged suffix array: never read */
    int64_t available = bytes - offset, n = length < available ? length : available;
    int c = memcmp(text + offset, pattern, n);
    if (c != 0) return c;
    return n < length ? -1 : 0;
}

typedef struct {
    const uint8_t *text;
    int64_t bytes, rows;
    int width;
    const void *suffix_array;
    int wide;  /* suffix array of int64 (else int32) byte offsets */
} SuffixArray;

static int64_t sa_offset(const SuffixArray *s, int64_t row) {
    return s->wide ? ((const int64_t *)s->suffix_array)[row]
                   : ((const int32_t *)s->suffix_array)[row];
}

/* Rows [*lo, *hi) of the suffixes that start with the pattern. */
static void sa_range(const SuffixArray *s, const uint8_t *pattern, int64_t length, int64_t *lo,
                     int64_t *hi) {
    int64_t a = 0, b = s->rows;
    while (a < b) {  /* the first row not below the pattern */
        int64_t mid = a + (b - a) / 2;
        if (compare_suffix(s->text, s->bytes, sa_offset(s, mid), pattern, length) < 0) a = mid + 1;
        else b = mid;
    }
    *lo = a;
    b = s->rows;
    while (a < b) {  /* the first row above it */
        int64_t mid = a + (b - a) / 2;
        if (compare_suffix(s->text, s->bytes, sa_offset(s, mid), pattern, length) <= 0) a = mid + 1;
        else b = mid;
    }
    *hi = a;
}

/* `SparseIndex.match_rows`: the rows of the occurrences of symbols[0..n) followed by a token of
 * their document (those followed by the separator 0 come first in suffix order). */
static void match_rows(const SuffixArray *s, const int64_t *symbols, int64_t n, uint8_t *pattern,
                       int64_t *lo, int64_t *hi) {
    for (int64_t i = 0; i <= n; i++) {
        uint64_t symbol = i < n ? (uint64_t)symbols[i] : 0;
        for (int b = 0; b < s->width; b++)
            pattern[i * s->width + b] = (uint8_t)(symbol >> (8 * (s->width - 1 - b)));
    }
    int64_t first, last, end_first, end_last;
    sa_range(s, pattern, n * s->width, &first, &last);
    if (last == first) { *lo = *hi = 0; return; }
    sa_range(s, pattern, (n + 1) * s->width, &end_first, &end_last);
    *lo = first + (end_last - end_first);
    *hi = last;
}

/* REST's steps 1-5 (drafters/rest.py) over one suffix array: the longest n in
 * [min_suffix, usable] whose last n symbols of `tail` match (binary search: a match of n holds
 * one of n - 1), the continuations of its first max_matches matches, and the leaves of the
 * trie of their max_nodes most frequent prefixes, written as symbols (leaf i: leaf_symbols[i *
 * draft_len ..], leaf_lengths[i] of them). `tail`: the context's last symbols, none unknown
 * (the caller cuts at the last unknown one). Returns the leaf count, -1 when out of memory;
 * *match_len = n (0: no match). */
static int dresd_rest_draft(const uint8_t *text, int64_t bytes, int width,
                            const void *suffix_array, int wide, int64_t rows,
                            const int64_t *tail, int64_t tail_len, int min_suffix,
                            int max_matches, int draft_len, int max_nodes,
                            int32_t *leaf_symbols, int32_t *leaf_lengths, int32_t *match_len) {
    SuffixArray s = {text, bytes, rows, width, suffix_array, wide};
    *match_len = 0;
    uint8_t *pattern = malloc((tail_len + 1) * width + 1);
    if (!pattern) return -1;
    int64_t lo_n = min_suffix, hi_n = tail_len, best = 0, best_lo = 0, best_hi = 0;
    while (lo_n <= hi_n) {  /* invariant: every n < lo_n matches, none > hi_n does */
        int64_t n = (lo_n + hi_n) / 2, lo, hi;
        match_rows(&s, tail + tail_len - n, n, pattern, &lo, &hi);
        if (hi > lo) { best = n; best_lo = lo; best_hi = hi; lo_n = n + 1; }
        else hi_n = n - 1;
    }
    free(pattern);
    if (best == 0) return 0;
    *match_len = (int32_t)best;
    int64_t m = best_hi - best_lo < max_matches ? best_hi - best_lo : max_matches;
    int32_t *continuations = malloc(sizeof(int32_t) * m * draft_len);
    if (!continuations) return -1;
    int64_t symbols = bytes / width;
    for (int64_t r = 0; r < m; r++) {  /* the symbols after the match, zeros from its end on */
        int64_t start = sa_offset(&s, best_lo + r) / width + best, ended = 0;
        for (int j = 0; j < draft_len; j++) {
            int64_t position = start + j;
            uint32_t symbol = 0;
            if (!ended && position >= 0 && position < symbols)
                for (int b = 0; b < width; b++) symbol = symbol << 8 | text[position * width + b];
            if (symbol == 0) ended = 1;
            continuations[r * draft_len + j] = (int32_t)symbol;
        }
    }
    int32_t *leaf_rows = malloc(sizeof(int32_t) * max_nodes * 2);
    if (!leaf_rows) { free(continuations); return -1; }
    /* Suffix order sorts the continuations already (0, the separator, is the least symbol). */
    int leaves = dresd_frequent_prefixes(continuations, m, draft_len, 1, max_nodes, leaf_rows,
                                         leaf_rows + max_nodes);
    for (int i = 0; i < leaves; i++) {
        leaf_lengths[i] = leaf_rows[max_nodes + i];
        memcpy(leaf_symbols + (int64_t)i * draft_len, continuations + (int64_t)leaf_rows[i] * draft_len,
               sizeof(int32_t) * leaf_lengths[i]);
    }
    free(leaf_rows);
    free(continuations);
    return leaves;
}

/* DReSD's neighbours' drafts (drafters/dense.py `neighbour_drafts`): for each searched entry id,
 * in rank order, its position p = offsets[id] in the stream and its value, the tokens
 * stream[p + 1 .. min(p + 1 + value_len, the end of p's document)); an entry is kept when its
 * value starts with the bonus token (its context predicted the same next token), and its draft
 * is the value's next draft_len tokens at most. Writes each kept draft as a row of
 * `draft_len` token ids + 1 followed by zeros (what `dresd_frequent_prefixes` takes); returns the
 * rows written. offsets: uint32 (offset_width 4) or int64 (8), `entries` of them; stream: uint16
 * (2) or uint32 (4). The store's files are not trusted: an id outside the offsets, a position
 * outside the stream is skipped, and a value never runs past the stream's end
 * (`drafting.dense_store` checks the arrays once where they are opened). */
int dresd_dense_drafts(const int64_t *ids, int count, const void *offsets, int offset_width,
                       int64_t entries, const void *stream, int token_width, int64_t stream_len,
                       const int64_t *doc_starts, int64_t documents, int value_len,
                       int64_t bonus, int draft_len, int32_t *rows) {
    int kept = 0;
    for (int i = 0; i < count; i++) {
        if (ids[i] < 0 || ids[i] >= entries) continue;  /* FAISS pads a short result with -1 */
        int64_t position = offset_width == 4 ? ((const uint32_t *)offsets)[ids[i]]
                                             : ((const int64_t *)offsets)[ids[i]];
        int64_t start = position + 1;
        if (position < 0 || start >= stream_len) continue;
        /* the bonus filter first: most neighbours fail it, and need no document lookup */
        int64_t first = token_width == 2 ? ((const uint16_t *)stream)[start]
                                         : ((const uint32_t *)stream)[start];
        if (first != bonus) continue;
        /* the document holding `position`: the last start <= position */
        int64_t a = 0, b = documents;
        while (b - a > 1) {
            int64_t mid = (a + b) / 2;
            if (doc_starts[mid] <= position) a = mid; else b = mid;
        }
        int64_t end = start + value_len;
        if (end > doc_starts[a + 1]) end = doc_starts[a + 1];
        if (end > stream_len) end = stream_len;
        int32_t *row = rows + (int64_t)kept * draft_len;
        int j = 0;
        for (int64_t at = start + 1; at < end && j < draft_len; at++, j++)
            row[j] = (int32_t)(token_width == 2 ? ((const uint16_t *)stream)[at]
                                                : ((const uint32_t *)stream)[at]) + 1;
        for (; j < draft_len; j++) row[j] = 0;
        kept++;
    }
    return kept;
}

/* DReSD's key for one hidden state (`KeyTransform.apply` for one row): key = W h + b, scaled
 * to unit length. weight_t: W transposed, [d][dim] float32, so that each input's column is
 * contiguous and every output sums its d products in increasing k (one pass over W, whatever
 * the vector width). hidden: d bf16 (the forward's own row) or float32. A key that is all
 * zeros stays zeros (the floor 1e-12 on the norm, as the Python's). */
void dresd_dense_key(const void *hidden, int hidden_bf16, int d, const float *weight_t,
                     const float *bias, int dim, float *key) {
    for (int j = 0; j < dim; j++) key[j] = 0.0f;
    for (int k = 0; k < d; k++) {
        float h;
        if (hidden_bf16) {
            uint32_t bits = (uint32_t)((const uint16_t *)hidden)[k] << 16;
            memcpy(&h, &bits, sizeof h);
        } else {
            h = ((const float *)hidden)[k];
        }
        const float *column = weight_t + (int64_t)k * dim;
        for (int j = 0; j < dim; j++) key[j] += column[j] * h;
    }
    double norm = 0.0;
    for (int j = 0; j < dim; j++) {
        key[j] += bias[j];
        norm += (double)key[j] * key[j];
    }
    float scale = (float)(1.0 / fmax(sqrt(norm), 1e-12));
    for (int j = 0; j < dim; j++) key[j] *= scale;
}

/* DReSD's candidates for hybrid (`dense.agreeing_prefixes`): `rows` are the kept neighbours'
 * drafts in rank order, m rows of `width` token ids + 1 followed by zeros. Each distinct draft
 * with its count, cut where no other draft follows it: one token past the longest prefix it
 * shares with another, in lexicographic order; the nearest neighbour's draft (row 0) and
 * repeated drafts stay whole. Sorts `rows` in place and writes the candidates over its first
 * rows as token ids (lengths, counts: each one's); returns how many. */
int dresd_agreeing_prefixes(int32_t *rows, int64_t m, int64_t width, int32_t *lengths,
                            int32_t *counts) {
    if (m == 0) return 0;
    int32_t *nearest = malloc(sizeof(int32_t) * width);
    if (!nearest) return -1;
    memcpy(nearest, rows, sizeof(int32_t) * width);
    row_width = width;
    qsort(rows, m, sizeof(int32_t) * width, by_row);
    /* distinct rows to the front, each with its count and whether it is the nearest's */
    int64_t groups = 0;
    int near_group = -1;
    for (int64_t r = 0; r < m; r++) {
        int32_t *row = rows + r * width;
        if (groups > 0 && !memcmp(row, rows + (groups - 1) * width, sizeof(int32_t) * width)) {
            counts[groups - 1]++;
            continue;
        }
        if (r != groups) memcpy(rows + groups * width, row, sizeof(int32_t) * width);
        int64_t length = 0;
        while (length < width && row[length]) length++;
        lengths[groups] = (int32_t)length;
        counts[groups] = 1;
        if (!memcmp(row, nearest, sizeof(int32_t) * width)) near_group = (int)groups;
        groups++;
    }
    free(nearest);
    /* shared[g]: the longest common prefix of groups g and g + 1 */
    int32_t previous = 0;
    for (int64_t g = 0; g < groups; g++) {
        int32_t *row = rows + g * width, next = 0;
        if (g + 1 < groups) {
            int32_t *other = rows + (g + 1) * width;
            int32_t limit = lengths[g] < lengths[g + 1] ? lengths[g] : lengths[g + 1];
            while (next < limit && row[next] == other[next]) next++;
        }
        int32_t cut = (previous > next ? previous : next) + 1;
        int whole = groups < 2 || counts[g] > 1 || g == near_group;
        if (!whole && cut < lengths[g]) lengths[g] = cut;
        for (int32_t j = 0; j < lengths[g]; j++) row[j] -= 1;  /* ids + 1 -> ids */
        previous = next;
    }
    return (int)groups;
}

/* `dresd_rest_draft` from token ids to token ids: the context's last `count` ids become
 * symbols by `symbol_of` (an id outside the table, or without a symbol, is unknown: -1), cut
 * after the last unknown one; the leaves' symbols become ids again (alphabet[symbol - 1]).
 * The match's length stays here: the drafter has no use for it. */
int dresd_rest_lookup(const uint8_t *text, int64_t bytes, int width, const void *suffix_array,
                      int wide, int64_t rows, const int64_t *token_ids, int64_t count,
                      const int64_t *symbol_of, int64_t table_len, const int64_t *alphabet,
                      int min_suffix, int max_matches, int draft_len, int max_nodes,
                      int32_t *leaf_tokens, int32_t *leaf_lengths) {
    int64_t *tail = malloc(sizeof(int64_t) * (count + 1));
    if (!tail) return -1;
    int64_t tail_len = 0;
    for (int64_t i = 0; i < count; i++) {
        int64_t id = token_ids[i];
        int64_t symbol = id >= 0 && id < table_len ? symbol_of[id] : -1;
        if (symbol < 0) tail_len = 0;  /* a match cannot hold a token the corpus never has */
        else tail[tail_len++] = symbol;
    }
    int32_t match_len;
    int leaves = dresd_rest_draft(text, bytes, width, suffix_array, wide, rows, tail, tail_len,
                                  min_suffix, max_matches, draft_len, max_nodes, leaf_tokens,
                                  leaf_lengths, &match_len);
    free(tail);
    for (int i = 0; i < leaves; i++)
        for (int j = 0; j < leaf_lengths[i]; j++) {
            int32_t *at = leaf_tokens + (int64_t)i * draft_len + j;
            *at = (int32_t)alphabet[*at - 1];
        }
    return leaves;
}

/* ---------------------------------------------------------------------------------------------
 * Prompt lookup (drafters/lookup.py): the drafts after earlier occurrences of the context's end.
 * ------------------------------------------------------------------------------------------- */

/* For n from min(max_ngram, len - 1) (at least 1) down to min_ngram: the earlier n-grams equal
 * to the context's last n tokens, each ending at e <= len - 2; the first n with one wins, and
 * the tokens after each of its matches (most recent first), up to draft_len, are drafts, each
 * distinct one kept, num_drafts at most. Writes them as rows of draft_len (lengths: each one's);
 * returns their count. */
int dresd_prompt_lookup(const int64_t *tokens, int64_t len, int max_ngram, int min_ngram,
                        int draft_len, int num_drafts, int32_t *drafts, int32_t *lengths) {
    int64_t longest = len - 1 < max_ngram ? len - 1 : max_ngram;
    if (longest < 1) longest = 1;
    for (int64_t n = longest; n >= min_ngram; n--) {
        int count = 0;
        for (int64_t end = len - 2; end >= n - 1 && count < num_drafts; end--) {
            int64_t j = 0;
            while (j < n && tokens[end - j] == tokens[len - 1 - j]) j++;
            if (j < n) continue;
            int64_t length = len - 1 - end < draft_len ? len - 1 - end : draft_len;
            int seen = 0;
            for (int d = 0; d < count && !seen; d++) {
                if (lengths[d] != length) continue;
                int64_t k = 0;
                while (k < length && drafts[(int64_t)d * draft_len + k] == tokens[end + 1 + k])
                    k++;
                seen = k == length;
            }
            if (seen) continue;
            for (int64_t k = 0; k < length; k++)
                drafts[(int64_t)count * draft_len + k] = (int32_t)tokens[end + 1 + k];
            lengths[count++] = (int32_t)length;
        }
        if (count > 0) return count;
    }
    return 0;
}

/* DReSD's search where the store is an IVF index with fp16 codes (FAISS's
 * IndexIVFScalarQuantizer, QT_fp16, inner product), its lists read in place:
 *
 *   coarse(l)  = <q, centroid l>                      for every list l
 *   probed     = the nprobe lists of highest coarse(l)
 *   score(e)   = <q, code(e)> (+ coarse(l) where the codes hold e's residual from its list's
 *                centroid, `by_residual`)                for every entry e of a probed list
 *
 * and the k entries of highest score, best first: FAISS's search of the same index. Called alone
 * from Python it costs about what FAISS's does with the caches a forward leaves (~45-70 us,
 * `benchmarks/results/exact_vs_ivf.json`); what it buys is DReSD's query as one call
 * (`dresd_dense_neighbour_rows`). The coarse pass reads the centroids at half precision (half
 * the bytes), in blocks of 32 centroids ([block][dim][32], `centroid_blocks`), and re-scores
 * its best in float32: every list whose half-precision score lies within twice
 * the rounding bound of the nprobe-th best is re-scored exactly, so the lists probed are the
 * ones a float32 pass picks (`rounding_bound`: |q . c - q . half(c)| <= 2^-11 sum_i |q_i c_i|
 * <= 2^-11 |q| |c|, each half's relative rounding being at most 2^-11).
 *
 * codes[l], ids[l]: the addresses of list l's fp16 codes [sizes[l]][dim] and int64 ids (where
 * FAISS keeps them: the index must outlive the call). `max_norm`: the largest centroid's norm.
 * Writes k scores and ids, -1 after the last where the probed lists hold fewer than k entries;
 * returns how many were found, -1 where nprobe is not 1 to MAX_PROBES, -2 out of memory.
 * Equal scores rank as in FAISS's heaps: the lower id makes the list, and is listed after the
 * higher. Where the CPU has AVX2, FMA and F16C the products are 8 lanes wide, as FAISS's; else a
 * plain loop (sums in another order, so a score may differ from FAISS's in its last bits). */

#define CENTROID_BLOCK 32
#define MAX_PROBES 32 /* lists probed at most (more: FAISS searches, `ivf_lists`) */

static float half_to_float(uint16_t h) {
    /* exponent and mantissa moved into a float's places, then rescaled by 2^(127 - 15), which
     * also makes subnormals right. Inf and NaN (exponent 31) are not handled: keys are unit
     * vectors, centroids and residuals are small */
    uint32_t bits = (uint32_t)(h & 0x7fff) << 13;
    float magnitude;
    memcpy(&magnitude, &bits, sizeof magnitude);
    magnitude *= 0x1p112f;
    return (h & 0x8000) ? -magnitude : magnitude;
}

static float dot_f32_plain(const float *a, const float *b, int n) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static float dot_f16_plain(const float *q, const uint16_t *code, int n) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += q[i] * half_to_float(code[i]);
    return sum;
}

/* The half-precision scores of one block's 32 centroids. */
static void block_scores_plain(const float *q, const uint16_t *block, int dim, float *out) {
    for (int j = 0; j < CENTROID_BLOCK; j++) out[j] = 0.0f;
    for (int i = 0; i < dim; i++)
        for (int j = 0; j < CENTROID_BLOCK; j++)
            out[j] += q[i] * half_to_float(block[i * CENTROID_BLOCK + j]);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define WIDE __attribute__((target("avx2,fma,f16c")))

WIDE static float sum8(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
}

WIDE static float dot_f16_wide(const float *q, const uint16_t *code, int n) {
    __m256 sum = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(code + i)));
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), x, sum);
    }
    float total = sum8(sum);
    for (; i < n; i++) total += q[i] * half_to_float(code[i]);
    return total;
}

WIDE static void block_scores_wide(const float *q, const uint16_t *block, int dim, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < dim; i++, block += CENTROID_BLOCK) {
        __m256 qi = _mm256_set1_ps(q[i]);
        a0 = _mm256_fmadd_ps(qi, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block)), a0);
        a1 = _mm256_fmadd_ps(qi, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 8))), a1);
        a2 = _mm256_fmadd_ps(qi, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16))), a2);
        a3 = _mm256_fmadd_ps(qi, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 24))), a3);
    }
    _mm256_storeu_ps(out, a0);
    _mm256_storeu_ps(out + 8, a1);
    _mm256_storeu_ps(out + 16, a2);
    _mm256_storeu_ps(out + 24, a3);
}

static int wide_dots(void) {
    static int known = -1;
    if (known < 0)
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
                && __builtin_cpu_supports("f16c");
    return known;
}
#else
static float dot_f16_wide(const float *q, const uint16_t *c, int n) { return dot_f16_plain(q, c, n); }
static void block_scores_wide(const float *q, const uint16_t *b, int dim, float *out) {
    block_scores_plain(q, b, dim, out);
}
static int wide_dots(void) { return 0; }
#endif

/* Whether (a, a_id) ranks before (b, b_id): the higher score, on equal scores the lower id,
 * as FAISS's heaps rank them (so among equal keys the same ones make the list). */
static int ranks_before(float a, int64_t a_id, float b, int64_t b_id) {
    return a > b || (a == b && a_id < b_id);
}

/* Insert (score, id) into best[0..*filled) (ranked by `ranks_before`, at most `size`), if it
 * belongs. */
static void keep_best(float *best, int64_t *best_ids, int size, int *filled, float score,
                      int64_t id) {
    if (*filled == size && !ranks_before(score, id, best[size - 1], best_ids[size - 1])) return;
    int at = *filled < size ? (*filled)++ : size - 1;
    while (at > 0 && ranks_before(score, id, best[at - 1], best_ids[at - 1])) {
        best[at] = best[at - 1];
        best_ids[at] = best_ids[at - 1];
        at--;
    }
    best[at] = score;
    best_ids[at] = id;
}

/* How far a coarse score of the half-precision pass may lie from the float32 one: the halves'
 * rounding, 2^-11 |q| |c|, and both passes' float32 sums, within dim 2^-24 |q| |c| each. */
static float rounding_bound(const float *query, int dim, float max_norm) {
    float norm = sqrtf(dot_f32_plain(query, query, dim));
    return (0x1p-11f + (float)dim * 0x1p-23f) * norm * max_norm;
}

/* The nprobe lists of highest float32 coarse score, and those scores (module doc above);
 * -1 where out of memory. */
static int coarse_lists(const float *query, int dim, const float *centroids,
                        const uint16_t *centroid_blocks, int64_t nlist, float max_norm,
                        int nprobe, float *probe_scores, int64_t *probes, int wide) {
    int64_t blocks = (nlist + CENTROID_BLOCK - 1) / CENTROID_BLOCK;
    float *approx = malloc(sizeof(float) * blocks * CENTROID_BLOCK);
    if (!approx) return -1;
    for (int64_t b = 0; b < blocks; b++)
        (wide ? block_scores_wide : block_scores_plain)(
            query, centroid_blocks + b * CENTROID_BLOCK * dim, dim, approx + b * CENTROID_BLOCK);
    /* the nprobe-th best half-precision score, then every list within the bound of it */
    float best[MAX_PROBES];
    int64_t unused[MAX_PROBES];
    int ranked = 0;
    for (int64_t l = 0; l < nlist; l++) keep_best(best, unused, nprobe, &ranked, approx[l], l);
    float floor = best[ranked - 1] - 2.0f * rounding_bound(query, dim, max_norm);
    int probed = 0;
    for (int64_t l = 0; l < nlist; l++)
        if (approx[l] >= floor)
            keep_best(probe_scores, probes, nprobe, &probed,
                      dot_f32_plain(query, centroids + l * dim, dim), l);
    free(approx);
    return probed;
}

int dresd_ivf_search(const float *query, int dim, const float *centroids,
                     const uint16_t *centroid_blocks, int64_t nlist, float max_norm,
                     int nprobe, int by_residual, const int64_t *codes, const int64_t *ids,
                     const int64_t *sizes, int k, float *scores, int64_t *found_ids) {
    int wide = wide_dots();
    if (nprobe > MAX_PROBES || nprobe < 1 || nlist < 1) return -1;
    if (nprobe > nlist) nprobe = (int)nlist;
    float probe_scores[MAX_PROBES];
    int64_t probes[MAX_PROBES];
    int probed = coarse_lists(query, dim, centroids, centroid_blocks, nlist, max_norm, nprobe,
                              probe_scores, probes, wide);
    if (probed < 0) return -2;
    int filled = 0;
    for (int p = 0; p < probed; p++) {
        int64_t list = probes[p], size = sizes[list];
        const uint16_t *code = (const uint16_t *)(intptr_t)codes[list];
        const int64_t *list_ids = (const int64_t *)(intptr_t)ids[list];
        float base = by_residual ? probe_scores[p] : 0.0f;
        for (int64_t e = 0; e < size; e++, code += dim) {
            float score = base + (wide ? dot_f16_wide(query, code, dim)
                                       : dot_f16_plain(query, code, dim));
            keep_best(scores, found_ids, k, &filled, score, list_ids[e]);
        }
    }
    /* FAISS lists entries of equal score by decreasing id: each run of equal scores reversed */
    for (int first = 0, last; first < filled; first = last + 1) {
        last = first;
        while (last + 1 < filled && scores[last + 1] == scores[first]) last++;
        for (int a = first, b = last; a < b; a++, b--) {
            int64_t id = found_ids[a];
            found_ids[a] = found_ids[b];
            found_ids[b] = id;
        }
    }
    for (int i = filled; i < k; i++) {
        scores[i] = -FLT_MAX; /* as FAISS marks them */
        found_ids[i] = -1;
    }
    return filled;
}

/* DReSD's whole query in one call, where the store's index is one `dresd_ivf_search` reads:
 * the key of the hidden state (`dresd_dense_key`), its k nearest entries, and their drafts
 * (`dresd_dense_drafts`). From Python these were three calls, each 10-20 us with the caches a
 * forward leaves whatever its work (a ctypes call of 7-14 arguments ~9-11 us, a numpy output
 * array ~4, a trivial Python call ~2; FAISS's wrapper more). `plan`: what stays
 * the same from call to call, set once (`drafting.DensePlan`). Returns the rows written, or
 * < 0 as `dresd_ivf_search` does. */
struct dense_plan {
    const float *weight_t, *bias; /* the key transform (`dresd_dense_key`) */
    int64_t d, dim;
    const float *centroids; /* the IVF index (`dresd_ivf_search`) */
    const uint16_t *centroid_blocks;
    int64_t nlist, nprobe, by_residual;
    double max_norm;
    const int64_t *codes, *ids, *sizes;
    const void *offsets; /* the store (`dresd_dense_drafts`) */
    int64_t offset_width;
    const void *stream;
    int64_t token_width, stream_len;
    const int64_t *doc_starts;
    int64_t documents, value_len;
    int64_t entries; /* the offsets' count */
};

int dresd_dense_neighbour_rows(const struct dense_plan *plan, const void *hidden,
                               int hidden_bf16, int k, int64_t bonus, int draft_len,
                               int32_t *rows) {
    int64_t *found = malloc(sizeof(int64_t) * k + sizeof(float) * (plan->dim + k));
    if (!found) return -2;
    float *key = (float *)(found + k), *scores = key + plan->dim;
    dresd_dense_key(hidden, hidden_bf16, (int)plan->d, plan->weight_t, plan->bias,
                    (int)plan->dim, key);
    int status = dresd_ivf_search(key, (int)plan->dim, plan->centroids, plan->centroid_blocks,
                                  plan->nlist, (float)plan->max_norm, (int)plan->nprobe,
                                  (int)plan->by_residual, plan->codes, plan->ids, plan->sizes,
                                  k, scores, found);
    if (status >= 0)
        status = dresd_dense_drafts(found, status, plan->offsets, (int)plan->offset_width,
                                    plan->entries, plan->stream, (int)plan->token_width, plan->stream_len,
                                    plan->doc_starts, plan->documents, (int)plan->value_len,
                                    bonus, draft_len, rows);
    free(found);
    return status;
}

/* DReSD's candidates for hybrid in the same call: `dresd_dense_neighbour_rows`, then their
 * agreeing prefixes (`dresd_agreeing_prefixes`), written as one record: the number of
 * candidates, then for each its length, its count and its token ids. `record` holds
 * 1 + k * (draft_len + 2) values. Returns the values written, or < 0 as the query does. */
/* `dresd_dense_neighbour_rows`, then their agreeing prefixes: the candidates in `rows`' first
 * rows, each one's length and count after the k * draft_len row values (k lengths, then k
 * counts). Returns how many, or < 0 as the query does (-2: out of memory). */
static int dense_groups(const struct dense_plan *plan, const void *hidden, int hidden_bf16,
                        int k, int64_t bonus, int draft_len, int32_t *rows) {
    int32_t *lengths = rows + (int64_t)k * draft_len, *counts = lengths + k;
    int kept = dresd_dense_neighbour_rows(plan, hidden, hidden_bf16, k, bonus, draft_len, rows);
    if (kept < 0) return kept;
    int groups = dresd_agreeing_prefixes(rows, kept, draft_len, lengths, counts);
    return groups < 0 ? -2 : groups;
}

int dresd_dense_candidates(const struct dense_plan *plan, const void *hidden, int hidden_bf16,
                           int k, int64_t bonus, int draft_len, int32_t *record) {
    int32_t *rows = malloc(sizeof(int32_t) * ((int64_t)k * draft_len + 2 * (int64_t)k));
    if (!rows) return -2;
    int32_t *lengths = rows + (int64_t)k * draft_len, *counts = lengths + k;
    int groups = dense_groups(plan, hidden, hidden_bf16, k, bonus, draft_len, rows);
    if (groups < 0) {
        free(rows);
        return groups;
    }
    int64_t at = 0;
    record[at++] = groups;
    for (int g = 0; g < groups; g++) {
        record[at++] = lengths[g];
        record[at++] = counts[g];
        memcpy(record + at, rows + (int64_t)g * draft_len, sizeof(int32_t) * lengths[g]);
        at += lengths[g];
    }
    free(rows);
    return (int)at;
}

/* ---------------------------------------------------------------------------------------------
 * Hybrid's whole step in one call, where each of its sources has its lookup here: PLD's, the
 * suffix drafter's tree over the request, REST's and DReSD's, each source's candidates as
 * `Drafter.candidates` gives them, then `dresd_hybrid_draft`. From Python the same step is one
 * call per source, each with its arrays in and lists out (~25-30 us a source with the caches a
 * forward leaves, most of it Python), and Python building the candidates' arrays (~15 us).
 * ------------------------------------------------------------------------------------------- */

enum { SOURCE_PLD, SOURCE_SUFFIX, SOURCE_REST, SOURCE_DENSE };

/* What stays the same from step to step (`drafting.HybridSources`, field for field). */
struct hybrid_sources {
    int64_t pld_max_ngram, pld_min_ngram, pld_num_drafts;
    int64_t suffix_max_depth, suffix_max_nodes, suffix_single_path;
    double suffix_factor, suffix_offset, suffix_min_prob;
    const uint8_t *rest_symbols;
    int64_t rest_symbols_bytes, rest_symbol_width;
    const void *rest_suffix_array;
    int64_t rest_wide, rest_suffixes;
    const int64_t *rest_symbol_of;
    int64_t rest_table_len;
    const int64_t *rest_alphabet;
    int64_t rest_min_suffix, rest_max_suffix, rest_max_matches, rest_max_nodes;
    const struct dense_plan *dense;
    int64_t dense_k;
};

/* The candidates of one step, as `dresd_hybrid_draft` takes them. */
typedef struct {
    int64_t *tokens, *offsets, *sources, *neighbours;
    double *shares;
    int count;
} Candidates;

static void add_candidate(Candidates *c, const int32_t *tokens, int length, int64_t source,
                          int64_t neighbours, const double *shares) {
    int64_t at = c->offsets[c->count];
    for (int i = 0; i < length; i++) {
        c->tokens[at + i] = tokens[i];
        c->shares[at + i] = shares ? shares[i] : NAN;
    }
    c->sources[c->count] = source;
    c->neighbours[c->count] = neighbours;
    c->offsets[++c->count] = at + length;
}

static double seconds_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* The suffix source's candidates: the request tree's root-to-leaf paths (leaves in the order
 * they were added), each token with its share prob(node) / prob(parent), as
 * `SpeculationTree.paths` gives them; or, where the global trie's tree scores higher (`global`:
 * its paths, given), those. */
static int suffix_candidates(const struct hybrid_sources *s, const int64_t *context, int64_t n,
                             int max_len, const int64_t *global_tokens,
                             const int64_t *global_offsets, const double *global_shares,
                             int global_count, double global_score, int64_t bit,
                             Candidates *out) {
    int max_nodes = (int)s->suffix_max_nodes, longest = max_nodes; /* a path's tokens at most */
    for (int c = 0; c < global_count; c++)
        if (global_offsets[c + 1] - global_offsets[c] > longest)
            longest = (int)(global_offsets[c + 1] - global_offsets[c]);
    int32_t *tokens = malloc(sizeof(int32_t) * (2 * max_nodes + longest)
                             + sizeof(double) * (max_nodes + longest) + 8);
    if (!tokens) return -1;
    int32_t *parents = tokens + max_nodes, *path = parents + max_nodes;
    double *probs = (double *)(((uintptr_t)(path + longest) + 7) & ~(uintptr_t)7);
    double *shares = probs + max_nodes;
    int32_t match_len;
    int count = dresd_suffix_context_tree(context, n, (int)s->suffix_max_depth, s->suffix_factor,
                                          s->suffix_offset, max_nodes, s->suffix_min_prob,
                                          max_len, (int)s->suffix_single_path, tokens, parents,
                                          probs, &match_len);
    if (count < 0) {
        free(tokens);
        return -1;
    }
    double score = 0.0;
    for (int i = 0; i < count; i++) score += probs[i];
    if (global_count >= 0 && global_score > score) {
        for (int c = 0; c < global_count; c++) {
            int length = (int)(global_offsets[c + 1] - global_offsets[c]);
            for (int i = 0; i < length; i++) path[i] = (int32_t)global_tokens[global_offsets[c] + i];
            add_candidate(out, path, length, bit, 0, global_shares + global_offsets[c]);
        }
        free(tokens);
        return 0;
    }
    uint8_t has_child[max_nodes > 0 ? max_nodes : 1];
    memset(has_child, 0, sizeof has_child);
    for (int i = 0; i < count; i++)
        if (parents[i] >= 0) has_child[parents[i]] = 1;
    for (int leaf = 0; leaf < count; leaf++) {
        if (has_child[leaf]) continue;
        int length = 0;
        for (int node = leaf; node >= 0; node = parents[node]) length++;
        int at = length;
        for (int node = leaf; node >= 0; node = parents[node]) {
            at--;
            path[at] = tokens[node];
            shares[at] = probs[node] / (parents[node] >= 0 ? probs[parents[node]] : 1.0);
        }
        add_candidate(out, path, length, bit, 0, shares);
    }
    free(tokens);
    return 0;
}

/* One hybrid step: the sources `kinds[0..sources)` (SOURCE_*, in hybrid's order, each with its
 * table bit in `bits`) consulted on the context (`context`, n tokens; `hidden`: its last state,
 * for DReSD), each one's seconds written to `seconds`, their candidates merged and cut by
 * `dresd_hybrid_draft` (whose arguments follow, as hybrid passes them). `draft_len`: the
 * sources' draft length (hybrid's, cut to the tokens left: `max_draft_len`). `global_*`: the
 * suffix drafter's tree of its global trie, where it has one (global_count -1: none). Returns
 * what `dresd_hybrid_draft` returns, -1 out of memory or room. */
int dresd_hybrid_step(const struct hybrid_sources *s, const int32_t *kinds, const int64_t *bits,
                      int sources, const int64_t *context, int64_t n, const void *hidden,
                      int hidden_bf16, int draft_len, int max_draft_len,
                      const int64_t *global_tokens, const int64_t *global_offsets,
                      const double *global_shares, int global_count, double global_score,
                      double *seconds, const int32_t *last_tree, int last_capacity,
                      const int64_t *emitted, int emitted_count, int num_sources, int32_t *tree,
                      int capacity, double *accepted, double *tried, const double *prior,
                      double strength, const double *costs, int max_nodes, int32_t *record) {
    /* room: every source's candidates at their longest */
    int64_t most = 0, most_tokens = 0;
    for (int i = 0; i < sources; i++) {
        int64_t count = kinds[i] == SOURCE_PLD ? s->pld_num_drafts
                      : kinds[i] == SOURCE_SUFFIX ? s->suffix_max_nodes
                                                    + (global_count > 0 ? global_count : 0)
                      : kinds[i] == SOURCE_REST ? s->rest_max_nodes : s->dense_k;
        int64_t length = kinds[i] != SOURCE_SUFFIX ? draft_len  /* a suffix path: <= D - 1 */
                       : max_draft_len < s->suffix_max_depth ? max_draft_len : s->suffix_max_depth;
        most += count;
        most_tokens += count * length;
    }
    if (global_count > 0) most_tokens += global_offsets[global_count];
    Candidates c = {0};
    c.tokens = malloc(sizeof(int64_t) * (most_tokens + 3 * most + 2) + sizeof(double) * (most_tokens + 1));
    int32_t *rows = malloc(sizeof(int32_t) * (most_tokens + 3 * most + 2));
    if (!c.tokens || !rows) {
        free(c.tokens);
        free(rows);
        return -1;
    }
    c.offsets = c.tokens + most_tokens + 1;
    c.sources = c.offsets + most + 1;
    c.neighbours = c.sources + most;
    c.shares = (double *)(c.neighbours + most);
    c.offsets[0] = 0;
    int status = 0;
    for (int i = 0; i < sources && status >= 0; i++) {
        double started = seconds_now();
        if (kinds[i] == SOURCE_PLD && n > 0) {
            int32_t *lengths = rows + s->pld_num_drafts * draft_len;
            int found = dresd_prompt_lookup(context, n, (int)s->pld_max_ngram,
                                            (int)s->pld_min_ngram, draft_len,
                                            (int)s->pld_num_drafts, rows, lengths);
            for (int d = 0; d < found; d++)
                add_candidate(&c, rows + (int64_t)d * draft_len, lengths[d], bits[i], 0, NULL);
        } else if (kinds[i] == SOURCE_SUFFIX) {
            status = suffix_candidates(s, context, n, max_draft_len, global_tokens,
                                       global_offsets, global_shares, global_count,
                                       global_score, bits[i], &c);
        } else if (kinds[i] == SOURCE_REST) {
            int64_t tail = n < s->rest_max_suffix ? n : s->rest_max_suffix;
            int32_t *lengths = rows + s->rest_max_nodes * draft_len;
            int found = dresd_rest_lookup(
                s->rest_symbols, s->rest_symbols_bytes, (int)s->rest_symbol_width,
                s->rest_suffix_array, (int)s->rest_wide, s->rest_suffixes, context + n - tail,
                tail, s->rest_symbol_of, s->rest_table_len, s->rest_alphabet,
                (int)s->rest_min_suffix, (int)s->rest_max_matches, draft_len,
                (int)s->rest_max_nodes, rows, lengths);
            if (found < 0) status = -1;
            for (int d = 0; d < found; d++)
                add_candidate(&c, rows + (int64_t)d * draft_len, lengths[d], bits[i], 0, NULL);
        } else if (kinds[i] == SOURCE_DENSE && n > 0) {  /* the bonus token: the last */
            int k = (int)s->dense_k;
            int32_t *lengths = rows + (int64_t)k * draft_len, *counts = lengths + k;
            int groups = dense_groups(s->dense, hidden, hidden_bf16, k, context[n - 1],
                                      draft_len, rows);
            if (groups < 0) status = -1;
            for (int g = 0; g < groups; g++)
                add_candidate(&c, rows + (int64_t)g * draft_len, lengths[g], bits[i], counts[g],
                              NULL);
        }
        seconds[i] = seconds_now() - started;
    }
    if (status >= 0)
        status = dresd_hybrid_draft(last_tree, last_capacity, emitted, emitted_count,
                                    num_sources, tree, capacity, c.tokens, c.offsets, c.count,
                                    c.sources, c.neighbours, c.shares, draft_len, accepted,
                                    tried, prior, strength, costs, max_nodes, record);
    free(c.tokens);
    free(rows);
    return status;
}
