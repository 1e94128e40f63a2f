import math,os,sys
ws=[l.split()[0] for l in open('../../../scripts/router-workloads.txt') if l.strip()]
def rate(f):
    if not os.path.exists(f): return None
    for l in open(f):
        p=l.split()
        if len(p)>1 and p[0] in ('cache-aware','least-outstanding','sglang-cache-aware','dynamo-kv','llm-d'):
            return float(p[1])
def get(mode, w, seed, pol):
    if seed is None:
        return rate(f'b{mode}/{w}-{mode}__{pol}.txt')
    return rate(f'{mode}/{w}-s{seed}-{mode}__{pol}.txt')
gm=lambda x: math.exp(sum(map(math.log,x))/len(x))
same=0;diff=[]
for w in ws:
    for seed in [None,1,2,3]:
        for pol in ['sg','dy','lm']:
            a,b=get('ex',w,seed,pol),get('mt',w,seed,pol)
            if a==b: same+=1
            else: diff.append((w,seed,pol,a,b))
print('anchors sg/dy/lm equal under the bound:', same, 'differ:', diff)
for mode in ['ex','mt']:
    print(f'== {mode}')
    print(f"{'w':11s} " + ' '.join(f"{'s'+str(s) if s else 's42':>22s}" for s in [None,1,2,3]))
    rb=[];rl=[];rows={}
    for w in ws:
        cells=[]
        for seed in [None,1,2,3]:
            v={p:get(mode,w,seed,p) for p in ['ca','lo','sg','dy','lm']}
            best=max(v['lo'],v['sg'],v['dy'],v['lm'])
            rb.append(v['ca']/best); rl.append(v['ca']/v['lo'])
            cells.append(f"{v['ca']:6.2f}/{best:6.2f}={v['ca']/best:5.3f}")
        print(f"{w:11s} "+' '.join(f"{c:>22s}" for c in cells))
    print(f"{mode}: geomean ca/best {gm(rb):.4f}  min ca/best {min(rb):.3f}  min ca/LO {min(rl):.3f}  below LO: {sum(1 for x in rl if x<1)} of {len(rl)}  (56 runs)")
